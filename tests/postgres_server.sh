#!/usr/bin/env bash
# A PostgreSQL server for the ledger tests. Prints the URL of its `prereg_test` database on stdout, and nothing else.
#
# Idempotent, run by `make test` before pytest:
# - PREREG_TEST_POSTGRES_URL already set: prints it and touches nothing (the tests use that server);
# - otherwise installs Debian's `postgresql` package when pg_ctlcluster is missing (root only), starts the
#   cluster, creates a superuser role for the current user and the `prereg_test` database when missing.
# When it cannot (not root and no server, apt unreachable, a cluster that does not start), it prints ONE line on
# stderr saying the PostgreSQL tests will be skipped and why, prints no URL, and exits 0; with REQUIRE_POSTGRES=1
# (CI: `make test REQUIRE_POSTGRES=1`) it prints that line as an error and exits 1.
set -uo pipefail

DB=prereg_test

say() { echo "tests/postgres_server.sh: $*" >&2; }

give_up() {
  if [[ "${REQUIRE_POSTGRES:-}" == 1 ]]; then
    say "error: no PostgreSQL for the ledger tests, and REQUIRE_POSTGRES=1: $1"
    exit 1
  fi
  say "the PostgreSQL ledger tests will be skipped: $1"
  exit 0
}

# The last non-empty line a failed command printed, for a one-line reason.
last_line() { grep -v '^[[:space:]]*$' "$1" | tail -n 1; }

if [[ -n "${PREREG_TEST_POSTGRES_URL:-}" ]]; then
  printf '%s\n' "$PREREG_TEST_POSTGRES_URL"
  exit 0
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
user=$(id -un)
is_root=0
[[ $(id -u) == 0 ]] && is_root=1

# Run a command as the cluster's owner (postgres) when we are root, else as ourselves.
as_postgres() {
  if (( is_root )); then runuser -u postgres -- "$@"; else "$@"; fi
}

# --- install ------------------------------------------------------------------------------------------------------
if ! command -v pg_ctlcluster >/dev/null 2>&1; then
  (( is_root )) || give_up "PostgreSQL is not installed and installing it needs root (apt-get install postgresql); or set PREREG_TEST_POSTGRES_URL to a server you have"
  command -v apt-get >/dev/null 2>&1 || give_up "PostgreSQL is not installed and there is no apt-get to install it; set PREREG_TEST_POSTGRES_URL"
  say "installing Debian's postgresql package (apt-get, once)"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; } >"$log" 2>&1; then
    give_up "apt-get could not install postgresql: $(last_line "$log")"
  fi
  command -v pg_ctlcluster >/dev/null 2>&1 || give_up "apt-get installed postgresql but pg_ctlcluster is still missing"
fi

# --- the cluster --------------------------------------------------------------------------------------------------
# pg_lsclusters -h: "version name port status owner datadir logfile", one line per cluster; prefer one already online.
cluster=$(pg_lsclusters -h 2>/dev/null | awk '$4 ~ /^online/ {print $1, $2, $3, $4; exit}')
[[ -n "$cluster" ]] || cluster=$(pg_lsclusters -h 2>/dev/null | awk 'NR == 1 {print $1, $2, $3, $4}')
if [[ -z "$cluster" ]]; then
  (( is_root )) || give_up "PostgreSQL has no cluster, and creating one needs root (pg_createcluster)"
  version=$(ls /usr/lib/postgresql 2>/dev/null | sort -n | tail -n 1)
  [[ -n "$version" ]] || give_up "no PostgreSQL server binaries under /usr/lib/postgresql"
  say "creating the PostgreSQL $version cluster 'main'"
  pg_createcluster "$version" main >"$log" 2>&1 || give_up "pg_createcluster $version main failed: $(last_line "$log")"
  cluster=$(pg_lsclusters -h 2>/dev/null | awk -v v="$version" '$1 == v && $2 == "main" {print $1, $2, $3, $4; exit}')
  [[ -n "$cluster" ]] || give_up "pg_createcluster $version main left no cluster"
fi
read -r version name port status <<<"$cluster"

if [[ "$status" != online* ]]; then
  say "starting the PostgreSQL $version/$name cluster (port $port)"
  pg_ctlcluster "$version" "$name" start >"$log" 2>&1 \
    || give_up "the PostgreSQL $version/$name cluster is down and pg_ctlcluster $version $name start failed (it needs root or the cluster's owner): $(last_line "$log")"
fi

# --- the role and the database ------------------------------------------------------------------------------------
export PGPORT=$port  # every psql/createdb below talks to this cluster, over the local socket
if (( is_root )); then
  role=$(as_postgres psql -d postgres -tAc "SELECT 1 FROM pg_roles WHERE rolname = '$user'" 2>"$log") \
    || give_up "cannot connect to PostgreSQL as postgres: $(last_line "$log")"
  if [[ "$role" != 1 ]]; then
    as_postgres createuser -s "$user" >"$log" 2>&1 || give_up "createuser -s $user failed: $(last_line "$log")"
  fi
fi
exists=$(psql -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = '$DB'" 2>"$log") \
  || give_up "cannot connect to PostgreSQL as $user: $(last_line "$log")"
if [[ "$exists" != 1 ]]; then
  # Two runs racing: the loser's createdb fails with "already exists", which is fine; anything else is not.
  createdb "$DB" >"$log" 2>&1 || grep -q "already exists" "$log" || give_up "createdb $DB failed: $(last_line "$log")"
fi

url="postgresql:///$DB"
[[ "$port" == 5432 ]] || url="$url?port=$port"
psql "$url" -tAc "SELECT 1" >/dev/null 2>"$log" || give_up "cannot connect to $url: $(last_line "$log")"
printf '%s\n' "$url"
