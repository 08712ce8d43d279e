#!/usr/bin/env bash
# usage: bash bench/run_detached.sh start SECONDS [VAR=VALUE | STEP] ...
#        bash bench/run_detached.sh wait SECONDS
#
# run_gpu.sh's steps in a session of their own, so that they outlive a command that a remote
# runner stops at its time limit: `start` launches them and waits up to SECONDS, `wait` waits
# up to SECONDS more; both return early when the steps are done. Arguments run in order:
# VAR=VALUE is exported for the steps after it, anything else is one run_gpu.sh step, e.g.
#
#   bash bench/run_detached.sh start 540 mergetiles FP8_SEESAW_TESTS="lens1" fp8seesaw
#
# Work goes to $GB_DETACHED (default /tmp/graphbucket-detached): a copy of the checkout the
# steps run in (tree/), the log, the running steps' results (out/r) and, packed after every
# step, out/gpu-results.tgz. Each call, when it
# returns, copies that archive and the log into $OUT when OUT is set (the device tool's).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
W=${GB_DETACHED:-/tmp/graphbucket-detached}
usage() { sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; }
verb=${1:-}; secs=${2:-}
[[ "$verb" == -h || "$verb" == --help ]] && { usage; exit 0; }
if [[ ! "$verb" =~ ^(start|wait)$ || ! "$secs" =~ ^[0-9]+$ ]]; then
  usage >&2; exit 2
fi
shift 2
running() { [ -f "$W/pid" ] && [ ! -f "$W/rc" ] && kill -0 "$(cat "$W/pid")" 2>/dev/null; }

if [ "$verb" = start ]; then
  if running; then
    echo "run_detached.sh: steps already running (pid $(cat "$W/pid")); use wait" >&2; exit 2
  fi
  steps=()
  for arg in "$@"; do
    if [[ "$arg" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; then steps+=("export $(printf %q "$arg");")
    else steps+=("bash bench/run_gpu.sh $(printf %q "$arg");"); fi
  done
  rm -rf "$W"; mkdir -p "$W/out" "$W/tree"
  # The steps run in a copy of the checkout: a later device call re-sends the working tree,
  # which would replace what a step wrote into it (the ladder `tune` copies into
  # graphbucket/ladders/ for the steps after it) while they run.
  tar -cf - --exclude=./.triton-cache --exclude=./.venv --exclude=./.git . \
    | tar -xf - -C "$W/tree"
  # One run_gpu.sh per step, all packing into the same folder ($W/out/r accumulates).
  printf '%s\n' "cd $(printf %q "$W/tree")" \
    "export TRITON_CACHE_DIR=$(printf %q "${TRITON_CACHE_DIR:-$PWD/.triton-cache}")" \
    "export OUT=$(printf %q "$W/out")" "${steps[@]}" > "$W/queue.sh"
  echo 0 > "$W/pid"
  # The queue's shell writes its own pid (setsid may fork, and then $! is not the queue).
  setsid bash -c "echo \$\$ > $(printf %q "$W/pid"); bash $(printf %q "$W/queue.sh") \
    > $(printf %q "$W/log") 2>&1; echo \$? > $(printf %q "$W/rc")" < /dev/null > /dev/null 2>&1 &
  for _ in 1 2 3 4 5 6 7 8 9 10; do [ "$(cat "$W/pid")" != 0 ] && break; sleep 0.2; done
  echo "started: $(grep -c run_gpu "$W/queue.sh") step(s), log $W/log"
fi

[ -f "$W/pid" ] || { echo "run_detached.sh: nothing started (start first)" >&2; exit 2; }
end=$((SECONDS + secs)); shown=$(cat "$W/shown" 2>/dev/null || echo 0)  # log lines printed
while running && ((SECONDS < end)); do
  sleep 5
  lines=$({ wc -l < "$W/log"; } 2>/dev/null || echo 0)
  if ((lines > shown)); then sed -n "$((shown + 1)),${lines}p" "$W/log"; shown=$lines; fi
done
lines=$({ wc -l < "$W/log"; } 2>/dev/null || echo 0)
((lines > shown)) && sed -n "$((shown + 1)),${lines}p" "$W/log"
echo "$lines" > "$W/shown"
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  [ -f "$W/out/gpu-results.tgz" ] && cp "$W/out/gpu-results.tgz" "$OUT/"
  cp "$W/log" "$OUT/detached.log"
fi
if running; then echo "still running: bash bench/run_detached.sh wait SECONDS"
else echo "done: rc $(cat "$W/rc" 2>/dev/null || echo '?')"; fi
