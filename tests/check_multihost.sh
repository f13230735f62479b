#!/bin/sh
# Two "hosts" (issue 23): two Linux network namespaces joined by a veth pair
# with private addresses (10.231.0.1 and 10.231.0.2, which exist only inside
# them; no traffic leaves them), the file system shared as NFS would be.
# train_gpt runs across them
#   - over MPI: mpirun in host A, a hostfile naming both addresses, a launch
#     agent (plm_rsh_agent) that enters host B's namespace instead of ssh,
#     TCP only on the veth (btl tcp,self; btl/oob_tcp_if_include); once
#     with one rank per host, once with two (against the local backend at
#     4 ranks: ranks of one host exchange call descriptions through shared
#     memory, the hosts as messages);
#   - over Gloo, each rank started by hand in its host: directory
#     rendezvous (--store-dir on the shared file system), and TCP
#     rendezvous (--master HOST:PORT) when train_gpt --help offers it;
# and each run's final state (the CRC-32 of every tensor of its final
# checkpoint, parameters and AdamW state, and its final loss) must be
# bitwise the local backend's. Then a fault: host B's link goes down
# mid-run, and every process of the job (on both hosts) must be gone
# within the communication timeout (--timeout) plus a few seconds, with
# the error printed by at least one rank; on MPI and on Gloo.
# Needs root and `ip netns`; otherwise it is skipped (exit 77), saying why.
# Everything it creates (namespaces, veths, addresses, files) is removed on
# exit.
# Usage: check_multihost.sh path/to/train_gpt [path/to/mpirun|''] [gloo|'']
set -u
. "$(dirname "$0")/train_check.sh"
exe=${1:?usage: check_multihost.sh path/to/train_gpt [mpirun] [gloo]}
mpirun=${2:-}
gloo=${3:-}
case $exe in /*) ;; *) exe=$(pwd)/$exe ;; esac

. "$(dirname "$0")/two_hosts.sh"
[ -n "$mpirun$gloo" ] || skip "this build has neither MPI nor Gloo"
two_hosts mh 231 mh0

args="--layers 1 --dim 32 --heads 4 --batch 32 --ntest 32 --eval-every 0 --seed 5 --quiet"
steps=20
timeout=10 # --timeout of the fault runs
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# state DIR: one line that changes with any bit of the checkpoint's tensors
state() {
    for f in $(ls "$1"/model-*.safetensors | sort); do
        grep -ao '"fsdp\.crc32\.[^"]*":"[0-9a-f]*"' "$f"
    done | cksum | cut -d' ' -f1
}

# the reference: the local backend, 2 ranks
ref_log=$("$exe" --ranks 2 --steps $steps $args --save "$work/ref" 2>&1) || {
    echo "the local run failed:"; echo "$ref_log"; exit 1; }
ref_loss=$(final_loss "$ref_log")
ref_state=$(state "$work/ref")
echo "local, 2 ranks: final_loss $ref_loss, state $ref_state"

# same NAME LOG DIR: the run's final loss and state against the reference
same() {
    loss=$(final_loss "$2")
    st=$(state "$3" 2> /dev/null)
    echo "$1: final_loss ${loss:-none}, state ${st:-none}"
    [ "$loss" = "$ref_loss" ] && [ "$st" = "$ref_state" ] ||
        { fail "$1: not bitwise the local backend's"; echo "$2" | tail -5; }
}

# --- MPI -------------------------------------------------------------------
if [ -n "$mpirun" ]; then
    # the launch agent: what ssh would do, entering the host's namespace
    cat > "$work/agent.sh" << EOF
#!/bin/sh
host=\$1
shift
case \$host in $IPB) ns=$B ;; *) ns=$A ;; esac
exec ip netns exec \$ns unshare --uts sh -c "hostname host-\$ns; \$*"
EOF
    chmod +x "$work/agent.sh"
    printf '%s slots=1\n%s slots=1\n' $IPA $IPB > "$work/hostfile"
    # the sanitizers' settings reach the ranks on the other host too
    xs=""
    for v in ASAN_OPTIONS TSAN_OPTIONS UBSAN_OPTIONS LSAN_OPTIONS; do
        eval "[ -n \"\${$v:-}\" ]" && xs="$xs -x $v"
    done
    np=2
    mpi() {
        in_host $A "$mpirun" --allow-run-as-root $xs --hostfile "$work/hostfile" -np $np \
            --mca plm_rsh_agent "$work/agent.sh" --mca pml ob1 --mca btl tcp,self \
            --mca btl_tcp_if_include mh0 --mca oob_tcp_if_include mh0 \
            --mca oob_tcp_keepalive_time 2 --mca oob_tcp_keepalive_intvl 1 \
            --mca oob_tcp_keepalive_probes 3 "$@"
    }
    log=$(mpi "$exe" --backend mpi --steps $steps $args --save "$work/mpi" 2>&1) ||
        fail "mpi run failed: $log"
    same "mpi, 2 hosts" "$log" "$work/mpi"
    # two ranks on each host: the call descriptions go through shared memory
    # within a host and as MPI messages between the hosts (fsdp_comm_mpi.h)
    ref2_loss=$ref_loss ref2_state=$ref_state
    ref_log=$("$exe" --ranks 4 --steps $steps $args --save "$work/ref4" 2>&1) || {
        echo "the local 4-rank run failed:"; echo "$ref_log"; exit 1; }
    ref_loss=$(final_loss "$ref_log")
    ref_state=$(state "$work/ref4")
    echo "local, 4 ranks: final_loss $ref_loss, state $ref_state"
    printf '%s slots=2\n%s slots=2\n' $IPA $IPB > "$work/hostfile"
    np=4
    log=$(mpi "$exe" --backend mpi --steps $steps $args --save "$work/mpi4" 2>&1) ||
        fail "mpi run on 2 hosts x 2 ranks failed: $log"
    same "mpi, 2 hosts x 2 ranks" "$log" "$work/mpi4"
    np=2 ref_loss=$ref2_loss ref_state=$ref2_state
    printf '%s slots=1\n%s slots=1\n' $IPA $IPB > "$work/hostfile"
fi

# --- Gloo, ranks started by hand on each host -------------------------------
# gloo_pair NAME EXTRA...: rank 0 in host A, rank 1 in host B
gloo_pair() {
    name=$1
    shift
    in_host $A "$exe" --backend gloo --rank 0 --ranks 2 --host $IPA "$@" > "$work/$name.0" 2>&1 &
    p0=$!
    in_host $B "$exe" --backend gloo --rank 1 --ranks 2 --host $IPB "$@" > "$work/$name.1" 2>&1 &
    p1=$!
    pids="$pids $p0 $p1"
    wait $p0
    r0=$?
    wait $p1
    r1=$?
    [ $r0 = 0 ] && [ $r1 = 0 ] || fail "$name: exit $r0 / $r1: $(cat "$work/$name.0" "$work/$name.1")"
}
if [ -n "$gloo" ]; then
    mkdir "$work/store"
    gloo_pair gloo_dir --store-dir "$work/store" --steps $steps $args --save "$work/gloo_dir"
    same "gloo, 2 hosts, directory rendezvous" "$(cat "$work/gloo_dir.0")" "$work/gloo_dir"
    if "$exe" --help 2>&1 | grep -q -- --master; then
        gloo_pair gloo_tcp --master $IPA:29531 --steps $steps $args --save "$work/gloo_tcp"
        same "gloo, 2 hosts, TCP rendezvous" "$(cat "$work/gloo_tcp.0")" "$work/gloo_tcp"
    else
        echo "gloo, TCP rendezvous: not run (train_gpt --help has no --master)"
    fi
fi

# --- link down mid-run ------------------------------------------------------
# linkdown NAME: the job's pids in $job_pids; host B's link goes down 1 s
# after rank 0 printed step 1; every process must end within timeout + 8 s
fault_steps=100000
fargs="--layers 1 --dim 32 --heads 4 --batch 32 --ntest 32 --eval-every 0 --seed 5"
linkdown() {
    name=$1
    n=0
    while ! grep -q '^step *[0-9][0-9]*/' "$work/$name.0" 2> /dev/null && [ $n -lt 600 ]; do
        sleep 0.05
        n=$((n + 1))
    done
    sleep 1
    ip -n $B link set mh0 down
    t0=$(date +%s)
    n=0
    while [ $n -lt $(((timeout + ${GRACE:-8}) * 10)) ]; do
        alive=""
        for p in $job_pids $(ip netns pids $A) $(ip netns pids $B); do
            kill -0 "$p" 2> /dev/null && alive="$alive $p"
        done
        [ -z "$alive" ] && break
        sleep 0.1
        n=$((n + 1))
    done
    ended=$(($(date +%s) - t0))
    msg=$(cat "$work/$name".* 2> /dev/null | grep -m1 -i 'timed out\|timeout\|error\|fail')
    if [ -n "$alive" ]; then
        fail "$name: link down: processes still alive $((timeout + 8)) s later:" \
            "$(for p in $alive; do tr '\0' ' ' < /proc/$p/cmdline 2> /dev/null | cut -c1-60; echo; done)"
    else
        echo "$name: link down 1 s after step 1: every process gone ${ended} s later" \
            "(timeout ${timeout} s)"
    fi
    [ -n "$msg" ] && echo "$name: error printed: $msg" || fail "$name: no rank printed an error"
    ip -n $B link set mh0 up
    for p in $job_pids $(ip netns pids $A) $(ip netns pids $B); do kill -KILL "$p" 2> /dev/null; done
    wait 2> /dev/null
}
if [ -n "$mpirun" ]; then
    mpi "$exe" --backend mpi --steps $fault_steps $fargs --timeout $timeout \
        > "$work/mpi_down.0" 2> "$work/mpi_down.err" &
    job_pids=$!
    pids="$pids $job_pids"
    linkdown mpi_down
fi
if [ -n "$gloo" ]; then
    mkdir "$work/store2"
    job_pids=""
    for r in 0 1; do
        if [ $r = 0 ]; then ns=$A ip=$IPA; else ns=$B ip=$IPB; fi
        in_host $ns "$exe" --backend gloo --rank $r --ranks 2 --host $ip --store-dir "$work/store2" \
            --steps $fault_steps $fargs --timeout $timeout > "$work/gloo_down.$r" 2>&1 &
        job_pids="$job_pids $!"
    done
    pids="$pids $job_pids"
    linkdown gloo_down
fi

[ $fails = 0 ] || exit 1
echo "multi-host runs are bitwise the local backend's, and a link down ends the job"
