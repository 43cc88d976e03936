#!/usr/bin/env bash
# Runs the CPU test suite inside a loopback-only network namespace and a PID namespace of its own
# (needs root, as CI is). Every process a test starts lives in that PID namespace, so whatever still
# runs there once pytest has exited outlived the suite (a child no test reaped): it is listed, killed,
# and the run fails, keeping pytest's exit status when that is already non-zero. On success pytest's
# "N passed" line stays the last line of the output.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${RESERVOIR_TEST_NAMESPACE:-}" != "$$" ]; then
    [ -x .venv/bin/python ] && . .venv/bin/activate
    export PYTHONUNBUFFERED=1  # Ray's token auth stays on (Ray's default)
    # Inside, this script runs again as the namespace's PID 1 (unshare --fork), which adopts orphans
    exec env RESERVOIR_TEST_NAMESPACE=1 unshare -n -p -f --mount-proc bash "$0" "$@"
fi
ip link set lo up
rc=0
python -m pytest -q "$@" || rc=$?

# What still runs besides this shell. Builtins only (no subshell), so the scan sees no process of its
# own; zombies (already dead, no cmdline) are skipped.
leftovers() {
    local d line
    leaked=()
    for d in /proc/[0-9]*; do
        [ "${d#/proc/}" = "$$" ] && continue
        mapfile -d '' -t argv 2>/dev/null < "$d/cmdline" || continue
        [ "${#argv[@]}" -gt 0 ] || continue
        line="${d#/proc/} ${argv[*]}"
        leaked+=("$line")
    done
}
# A moment for processes already being stopped by the last teardown (e.g. after a SIGTERM) to exit
for _ in 1 2 3 4 5 6 7 8 9 10; do
    leftovers
    [ "${#leaked[@]}" -eq 0 ] && break
    sleep 0.5
done
[ "${#leaked[@]}" -eq 0 ] && exit "$rc"
echo "LEAKED PROCESSES: ${#leaked[@]} process(es) outlived the test suite (pid, command line); killing them:"
for line in "${leaked[@]}"; do
    echo "  $line"
    kill -KILL "${line%% *}" 2>/dev/null || true
done
[ "$rc" -ne 0 ] && exit "$rc"
exit 1
