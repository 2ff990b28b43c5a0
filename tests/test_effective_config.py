"""The effective config is frozen: a freeze records every run-config key of every rung (defaults included) and the
defaults table it resolved with; an amendment resolves new rungs with the frozen table; a run-start records its
rung's effective config; and every registration in the lab's ledger still resolves to the config it ran with, a
later change of a default notwithstanding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Cli, lab_ledger_copy, prereg_process, write

import engine.molmo2.run_config as run_config
from engine.molmo2.declaration import PROFILES
from engine.molmo2.run_config import RUN_CONFIG, Molmo2RunConfig, defaults, resolve
from prereg.ledger import Ledger
from prereg.state import config_defaults_of, load_state

KEYS = set(Molmo2RunConfig.model_fields)
CPU = PROFILES["cpu-tiny"]


def as_json(value):
    return json.loads(json.dumps(value))


def freeze_entry(ledger: Path, reg_id: str):
    with Ledger.open(str(ledger), create=False) as store:
        return next(store.entries(reg_id=reg_id, kinds=("freeze",)))


def test_a_freeze_records_every_key_of_every_rung_and_the_defaults_table(cli: Cli, mini: Path):
    cli.ok("freeze", mini)
    data = freeze_entry(cli.ledger, "mini").data
    assert data["config_defaults"] == as_json(defaults(CPU))
    rungs = data["effective_config"]["rungs"]
    assert set(rungs) == {"A", "B", "C"}
    for config in rungs.values():
        assert set(config) == KEYS  # defaults included
        assert config == as_json(resolve(CPU, {"batch": 4, "backward_chunks": 2}).model_dump(mode="json"))
    gate = data["effective_config"]["oracle_gate"]  # the oracle gate runs protocol.config alone
    assert gate == rungs["A"] and gate["lr"] == 1e-4 and gate["pack"] is False


def test_check_shows_the_effective_config_without_writing(cli: Cli, mini: Path):
    payload = cli.ok_json("check", mini)
    assert payload["frozen"] is False and payload["notes"] == []
    assert payload["config_defaults"] == as_json(defaults(CPU))
    assert set(payload["effective_config"]["rungs"]["B"]) == KEYS
    table = cli.ok("check", mini).stdout
    assert "effective config" in table and "· marks a default: cpu-tiny's current defaults" in table
    lr = next(line for line in table.splitlines() if line.startswith("│ lr "))
    chunks = next(line for line in table.splitlines() if line.startswith("│ backward_chunks "))
    assert lr.count("· 0.0001") == 3 and chunks.count("│ 2 ") == 3  # a default, and a value the document set
    assert not cli.ledger.exists()


AMENDMENT = """
reason = "a rung with a warm-up, declared before any data"
[[add.protocol.rungs]]
id = "D"
items = ["P1"]
config = { warmup = 10 }
"""


def test_an_amendment_resolves_new_rungs_with_the_frozen_defaults(cli: Cli, mini: Path, tmp_path: Path, monkeypatch):
    cli.ok("freeze", mini)
    frozen = freeze_entry(cli.ledger, "mini").data
    # The lab changes a default after the freeze: the frozen document, and its amendment, keep the frozen one.
    monkeypatch.setitem(run_config.CPU_DEFAULTS, "lr", 3e-4)
    monkeypatch.setitem(run_config.CPU_DEFAULTS, "max_crops", 2)
    assert resolve(CPU, {}).lr == 3e-4
    cli.ok("amend", "mini", write(tmp_path, "amend.toml", AMENDMENT))
    with Ledger.open(str(cli.ledger), create=False) as store:
        amend = next(store.entries(reg_id="mini", kinds=("amend",))).data
        state = load_state(store, "mini", with_windows=False)
    assert amend["config_defaults"] == frozen["config_defaults"]
    new_rung = amend["effective_config"]["rungs"]["D"]
    assert (new_rung["lr"], new_rung["max_crops"], new_rung["warmup"]) == (1e-4, 1, 10)
    assert {k: v for k, v in amend["effective_config"]["rungs"].items() if k != "D"} == frozen["effective_config"][
        "rungs"
    ]
    # The state resolves every version with the frozen table.
    for version in (0, 1):
        reg = state.registration_at(version)
        assert reg.effective_config("A").lr == 1e-4 and reg.config_defaults == frozen["config_defaults"]
    assert state.registration().effective_config("D").model_dump(mode="json") == new_rung
    payload = cli.ok_json("check", mini)
    assert payload["frozen"] is True and payload["effective_config"]["rungs"]["A"]["lr"] == 1e-4


RUN = """
id = "one-rung"
title = "a tiny CPU rung"
question = "does the run-start record its rung's effective config?"
workload = "molmo2"
profile = "cpu-tiny"

[cost]
ceiling_gpu_h = 0.5

[protocol]
steps = 2
log_every = 2
config = { batch = 2, backward_chunks = 1, camera_counts = [1], max_crops = 1 }

  [[protocol.rungs]]
  id = "A"
  config = { warmup = 3 }
"""


def test_a_run_start_records_its_rungs_effective_config(tmp_path: Path):
    path, ledger = write(tmp_path, "one-rung.toml", RUN), tmp_path / "ledger.db"
    Cli(ledger, tmp_path).ok("freeze", path)
    prereg_process("run", "one-rung", "--file", str(path), ledger=ledger, check=True)
    with Ledger.open(str(ledger), create=False) as store:
        start = next(store.entries(reg_id="one-rung", kinds=("run-start",))).data
        frozen = next(store.entries(reg_id="one-rung", kinds=("freeze",))).data
        end = next(store.entries(reg_id="one-rung", kinds=("run-end",))).data
    assert end["status"] == "finished"
    assert start["config"] == {"batch": 2, "backward_chunks": 1, "camera_counts": [1], "max_crops": 1, "warmup": 3}
    assert start["effective_config"] == frozen["effective_config"]["rungs"]["A"]
    assert set(start["effective_config"]) == KEYS and start["effective_config"]["warmup"] == 3


# --- the lab's ledger: every registration still means what it ran with ------------------------------------------

# What the runner did with a key a rung did not set, before freezes recorded their defaults (its
# `config.get(key, default)` calls, read off that code): the meaning of every raw config the lab's ledger holds.
RUNNER_GET_DEFAULTS = {
    "batch": 12,
    "backward_chunks": 1,
    "camera_counts": [1, 2],
    "max_crops": 1,
    "lr": 1e-4,
    "backbone_text_lr": 2e-5,
    "grad_clip": 100.0,
    "warmup": 0,
    "zero1": False,
    "ddp": False,
    "chunk_grad_allreduce": False,
    "ddp_wrapper": None,  # unset: with chunk_grad_allreduce, the DDP wrapper stays
    "memory_snapshot": False,
    "compile": False,
    "bucket_by_length": False,
    "chunk_by_cameras": False,
    "pack": False,
    "pack_attention": "packed",
    "pack_one_pass": False,
    "prefix_attention": "sdpa",
    "suffix_attention": "sdpa",
}
# Keys the runner read without a default (None: not set) or never read (fps, truncate_layers); switches were items.
UNSET_MEANT_NOTHING = {"pack_multiple": None, "compile_dynamic": None, "fps": None, "truncate_layers": None}


def meant(raw: dict, geometry: str) -> dict:
    """The effective config a raw run-start config meant to the runner of its day, in the typed config's terms:
    options of packing are null when a rung did not pack (the runner never consulted them); the wrapper option is
    true when allreduce ran with it unset, null without allreduce; no baseline switches; the FAST block the
    geometry built (1,024 ids at 4b, 48 tiny); inductor's default kernel sizing where it compiled."""
    fast = {"fast_vocab_size": {"4b": 1024, "tiny": 48}[geometry]}
    config = {**RUNNER_GET_DEFAULTS, **UNSET_MEANT_NOTHING, **fast, **raw, "baseline_switches": []}
    if not config["pack"]:
        config["pack_attention"] = config["pack_one_pass"] = None
    config["compile_tuning"] = "default" if config["compile"] else None  # inductor's heuristics, all there was
    if config["chunk_grad_allreduce"]:
        config["ddp_wrapper"] = config["ddp_wrapper"] is not False
    else:
        config["ddp_wrapper"] = None
    return config


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Ledger:
    ledger = Ledger.open(str(lab_ledger_copy(tmp_path_factory.mktemp("lab") / "ledger.db")), create=False)
    yield ledger
    ledger.close()


def test_every_frozen_and_amended_document_of_the_lab_validates(lab: Ledger):
    versions = 0
    for reg_id in lab.reg_ids():
        state = load_state(lab, reg_id, with_windows=False)
        freeze = next(iter(lab.entries(reg_id=reg_id, kinds=("freeze",))))
        if "config_defaults" in freeze.data:  # frozen since freezes record their defaults: those resolve it
            assert state.config_defaults == config_defaults_of(freeze.data) != dict(RUN_CONFIG.unrecorded_defaults)
        else:  # frozen before: the workload's table of the defaults the code had then
            assert state.config_defaults == dict(RUN_CONFIG.unrecorded_defaults)
        for version in state.versions:
            reg = state.registration_at(version.number)
            assert all(set(reg.effective_config(r.id).model_dump()) == KEYS for r in reg.protocol.rungs)
            versions += 1
    assert versions == 55  # 32 freezes and 23 amendments


def test_every_run_of_the_lab_resolves_to_the_config_it_ran_with(lab: Ledger):
    checked = 0
    for reg_id in lab.reg_ids():
        state = load_state(lab, reg_id, with_windows=False)
        for start in lab.entries(reg_id=reg_id, kinds=("run-start",)):
            data = start.data
            reg = state.registration_at(data["version"])
            rung = data.get("declared_rung") or data["rung"]
            effective = reg.effective_config(rung).model_dump(mode="json")
            geometry = reg.declaration().profiles[reg.profile].geometry
            if "effective_config" in data:  # recorded by the run itself: only keys added since are resolved anew
                recorded = data["effective_config"]
                added = {"fast_vocab_size": {"4b": 1024, "tiny": 48}[geometry],
                         "compile_tuning": "default" if recorded["compile"] else None}  # fmt: skip
                assert effective == {**added, **recorded}, (reg_id, rung)
            else:
                assert effective == meant(data["config"], geometry), (reg_id, rung)
            checked += 1
    assert checked == 49  # every run-start the lab's ledger holds


def test_a_change_of_default_leaves_an_old_document_alone(lab: Ledger, monkeypatch):
    before = {
        reg_id: load_state(lab, reg_id, with_windows=False).registration().effective_configs()
        for reg_id in lab.reg_ids()
    }
    for table in (run_config.CUDA_DEFAULTS, run_config.CPU_DEFAULTS):
        monkeypatch.setitem(table, "lr", 5e-4)
        monkeypatch.setitem(table, "pack", not table["pack"])
        monkeypatch.setitem(table, "backward_chunks", 2)
    assert resolve(PROFILES["h200-4b"], {}).lr == 5e-4  # the change took
    after = {
        reg_id: load_state(lab, reg_id, with_windows=False).registration().effective_configs()
        for reg_id in lab.reg_ids()
    }
    assert after == before


def test_a_recorded_table_outlives_a_change_of_default(cli: Cli, mini: Path, monkeypatch):
    cli.ok("freeze", mini)
    with Ledger.open(str(cli.ledger), create=False) as store:
        before = load_state(store, "mini", with_windows=False).registration().effective_configs()
        monkeypatch.setitem(run_config.CPU_DEFAULTS, "lr", 5e-4)
        monkeypatch.setitem(run_config.CPU_DEFAULTS, "camera_counts", (2,))
        after = load_state(store, "mini", with_windows=False).registration().effective_configs()
    assert after == before and before["rungs"]["A"]["lr"] == 1e-4
    assert cli.ok_json("check", mini)["effective_config"] == before  # check, too, resolves it as frozen
