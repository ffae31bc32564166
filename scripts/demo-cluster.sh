#!/usr/bin/env bash
# A recorded terminal session of the cluster commands against the emulated cluster
# (tests/operator/cluster_sim.py: the API emulator, the real operator process, and a
# simulated kubelet + trainer: no GPU, no real cluster). In a tmux pane it runs
#   cephalo plan --cluster --job examples/custom-tiny-gpt.yaml
#   cephalo submit examples/custom-tiny-gpt.yaml --watch      (to Succeeded)
#   cephalo status ; cephalo logs custom-tiny-gpt
# and prints tmux captures: one while the progress bar runs, and the whole session at the
# end. Usage: scripts/demo-cluster.sh [OUTPUT_DIR]  (captures also saved there).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-}
work=$(mktemp -d)
session="cephalo-demo-$$"
.venv/bin/python -I tests/operator/cluster_sim.py --kubeconfig "$work/kubeconfig" \
    --operator-log "$work/operator.log" >"$work/sim.log" 2>&1 &
sim=$!
cleanup() {
    tmux kill-session -t "$session" 2>/dev/null || true
    kill -TERM "$sim" 2>/dev/null || true
    wait "$sim" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
for _ in $(seq 150); do grep -q "emulated cluster ready" "$work/sim.log" && break; sleep 0.2; done
grep -q "emulated cluster ready" "$work/sim.log" || { cat "$work/sim.log"; exit 1; }
bin="$PWD/.venv/bin"
cat >"$work/session.sh" <<SESSION
export KUBECONFIG=$work/kubeconfig PATH=$bin:\$PATH PS1='\$ '
show() { printf '\$ %s\n' "\$1"; eval "\$1"; }
show "cephalo plan --cluster --job examples/custom-tiny-gpt.yaml | head -12"
show "cephalo submit examples/custom-tiny-gpt.yaml --watch"
echo "exit code \$?"
show "cephalo status"
show "cephalo logs custom-tiny-gpt | tail -4"
echo "demo done"
sleep 600
SESSION
tmux new-session -d -s "$session" -x 160 -y 50 "bash --norc $work/session.sh"
mid=""
for _ in $(seq 600); do
    pane=$(tmux capture-pane -p -t "$session")
    if [[ -z "$mid" && "$pane" == *"█"*"ETA"* && "$pane" != *"exit code"* ]]; then mid="$pane"; fi
    [[ "$pane" == *"demo done"* ]] && break
    sleep 0.1
done
final=$(tmux capture-pane -p -S - -t "$session")
printf '=== tmux capture while watching (live progress bar) ===\n%s\n' "$mid"
printf '=== tmux capture of the whole session ===\n%s\n' "$final"
if [[ -n "$out" ]]; then
    mkdir -p "$out"
    printf '%s\n' "$mid" >"$out/watch-live.txt"
    printf '%s\n' "$final" >"$out/session.txt"
fi
[[ "$final" == *"exit code 0"* ]]
