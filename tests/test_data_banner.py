"""The Molmo2 runner counts the data it trains on at load, and every window carries the counts: a kill line on
them (seed 003's E1 data gate, "any deviation aborts") fires on a run's first window."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import Cli, prereg_process

from engine.molmo2.data.rig import RigDataset
from engine.molmo2.runner import GEOMETRIES, data_banner
from prereg.ledger import Ledger
from prereg.state import load_state

ROOT = Path(__file__).resolve().parent.parent
MICRO = (ROOT / "tests" / "data" / "micro.toml").read_text()
GATE = "data_datasets != 878 or data_episodes != 38571 or data_frames != 18636749"


def test_the_banner_counts_the_runs_own_episodes_and_frames():
    data = RigDataset(0, 5, camera_counts=(1, 2))
    banner = data_banner([data])
    assert banner["data_datasets"] == 1 and banner["data_episodes"] == 5
    assert banner["data_frames"] == sum(data.sample(i).n_cameras for i in range(5))
    assert (banner["data_state_dim"], banner["data_action_dim"]) == (6, 6)


def test_a_data_gate_kills_the_first_window_of_a_run_whose_data_deviate(tmp_path: Path):
    path = tmp_path / "micro.toml"
    path.write_text(MICRO + f'\n[[kill]]\nid = "K-E1"\nwhen = "{GATE}"\nrungs = ["A"]\n')
    ledger = tmp_path / "ledger.db"
    Cli(ledger, tmp_path).ok("freeze", path)
    json.loads(prereg_process("run", "micro", "--file", str(path), "--json", ledger=ledger, check=True).stdout)
    with Ledger.open(str(ledger), create=False) as store:
        state = load_state(store, "micro")
    [a] = [r for r in state.runs if r.rung == "A"]
    assert a.status == "killed" and a.ended_by == {"kill": "K-E1"} and a.kill["step"] == 2  # the first window
    expected = data_banner([RigDataset(0, GEOMETRIES["tiny"].episodes, camera_counts=(1, 2), image_size=(42, 42))])
    assert {k: a.windows[0][k] for k in expected} == expected
    # the other rungs, which the line does not watch, train on with the same counts in every window
    [c] = [r for r in state.runs if r.rung == "C"]
    assert c.status == "finished" and all({k: w[k] for k in expected} == expected for w in c.windows)
