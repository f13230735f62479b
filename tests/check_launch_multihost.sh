#!/bin/sh
# The TCP rendezvous and a launcher's environment across two "hosts" (issue
# 35): two Linux network namespaces joined by a veth pair with private
# addresses (10.232.0.1 and 10.232.0.2, which exist only inside them), as in
# tests/check_multihost.sh.
#   - fsdp_rendezvous_create with rank 0 on host A and rank 1 on host B
#     (started first: it retries until rank 0 serves), then a broadcast and
#     a side-channel collection (tests/test_launch --rank);
#   - rank 0 given host A's address while it runs on host B: refused, naming
#     the address;
#   - train_gpt started as torchrun starts its workers on two nodes (RANK,
#     WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=host A, MASTER_PORT, ...), no
#     --backend: Gloo over the launcher's rendezvous, the same final loss as
#     the local backend.
# Needs root and `ip netns`; otherwise it is skipped (exit 77), saying why.
# Everything it creates (namespaces, veths, files) is removed on exit.
# Usage: check_launch_multihost.sh path/to/test_launch path/to/train_gpt [gloo|'']
set -u
. "$(dirname "$0")/train_check.sh"
tl=${1:?usage: check_launch_multihost.sh test_launch train_gpt [gloo]}
gpt=${2:?}
gloo=${3:-}
case $tl in /*) ;; *) tl=$(pwd)/$tl ;; esac
case $gpt in /*) ;; *) gpt=$(pwd)/$gpt ;; esac

. "$(dirname "$0")/two_hosts.sh"
two_hosts ln 232 ln0
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# a port inside the namespaces: nothing else runs there
port=$((20000 + $$ % 20000))

# --- the rendezvous: rank 1 on host B first, rank 0 on host A 0.5 s later ----
in_host $B "$tl" --rank 1 --ranks 2 --addr $IPA --port $port --job mh --timeout-ms 20000 \
    > "$work/r1" 2>&1 &
p1=$!
sleep 0.5
in_host $A "$tl" --rank 0 --ranks 2 --addr $IPA --port $port --job mh --timeout-ms 20000 \
    > "$work/r0" 2>&1 &
p0=$!
wait $p0
s0=$?
wait $p1
s1=$?
if [ $s0 = 0 ] && [ $s1 = 0 ] && grep -q "rendezvous ok" "$work/r0" && grep -q "rendezvous ok" "$work/r1"; then
    echo "rendezvous across hosts (rank 0 on $IPA, rank 1 on $IPB, which came first): ok"
else
    fail "rendezvous across hosts: $(cat "$work/r0" "$work/r1")"
fi

# --- rank 0 told an address of another host ------------------------------------
out=$(in_host $B "$tl" --rank 0 --ranks 2 --addr $IPA --port $((port + 1)) --timeout-ms 3000 \
    --expect "invalid arguments" --want "'$IPA' is not an address of this host" 2>&1)
if [ $? = 0 ]; then
    echo "rank 0 on host B given host A's address: refused, named"
else
    fail "rank 0 given another host's address: $out"
fi

# --- train_gpt as torchrun starts its workers on two nodes ---------------------
if [ -n "$gloo" ]; then
    args="--steps 10 --layers 1 --dim 32 --heads 4 --batch 32 --ntest 32 --eval-every 0 --seed 5 --quiet --timeout 30"
    ref=$(final_loss "$("$gpt" $args --ranks 2 2>&1)")
    # node r: GROUP_RANK r, one worker; the agent store is not emulated here
    # (TORCHELASTIC_USE_AGENT_STORE=False, as older c10d rendezvous set it)
    tenv() {
        echo "LOCAL_RANK=0 RANK=$1 GROUP_RANK=$1 ROLE_RANK=$1 ROLE_NAME=default" \
            "LOCAL_WORLD_SIZE=1 WORLD_SIZE=2 GROUP_WORLD_SIZE=2 ROLE_WORLD_SIZE=2" \
            "MASTER_ADDR=$IPA MASTER_PORT=$((port + 2)) TORCHELASTIC_RESTART_COUNT=0" \
            "TORCHELASTIC_MAX_RESTARTS=0 TORCHELASTIC_RUN_ID=mh" \
            "TORCHELASTIC_USE_AGENT_STORE=False"
    }
    in_host $A env $(tenv 0) "$gpt" $args --host $IPA > "$work/g0" 2>&1 &
    p0=$!
    in_host $B env $(tenv 1) "$gpt" $args --host $IPB > "$work/g1" 2>&1 &
    p1=$!
    wait $p0
    s0=$?
    wait $p1
    s1=$?
    got=$(final_loss "$(cat "$work/g0")")
    echo "train_gpt under torchrun's variables on 2 hosts: final_loss ${got:-none} (local: $ref)"
    [ $s0 = 0 ] && [ $s1 = 0 ] && [ "$got" = "$ref" ] || {
        fail "train_gpt across hosts: exit $s0 / $s1"
        # one file at a time: GNU tail refuses -3 before two files
        for f in "$work/g0" "$work/g1"; do
            echo "== $f"
            tail -n 3 "$f"
        done
    }
fi

[ $fails = 0 ] || exit 1
echo "the rendezvous and a launcher's environment work across hosts"
