# two_hosts.sh - sourced by check_multihost.sh and check_launch_multihost.sh:
# two "hosts", Linux network namespaces $A and $B joined by a veth pair with
# private addresses $IPA and $IPB that exist only inside them (no traffic
# leaves them). Everything made here (namespaces, the veth, $work) goes on
# exit, with the processes still running in a host and those in $pids.

skip() { echo "SKIP: $*"; exit 77; }

# two_hosts TAG OCTET IFNAME: hosts fsdp<TAG>A<pid> and ...B<pid> at
# 10.<OCTET>.0.1 and .2 on veth IFNAME, a fresh $work; skips (exit 77)
# without root or `ip netns`
two_hosts() {
    [ "$(id -u)" = 0 ] || skip "needs root (network namespaces)"
    command -v ip > /dev/null || skip "no ip command (iproute2)"
    command -v unshare > /dev/null || skip "no unshare (util-linux)"
    A=fsdp${1}A$$ B=fsdp${1}B$$
    IPA=10.$2.0.1 IPB=10.$2.0.2
    work=$(mktemp -d "${TMPDIR:-/tmp}/fsdp_${1}_XXXXXX") || exit 1
    pids=""
    trap two_hosts_cleanup EXIT
    trap 'exit 1' INT TERM HUP
    ip netns add $A 2> "$work/err" || skip "ip netns add failed: $(cat "$work/err")"
    ip netns add $B || exit 1
    # the veth is created inside the namespaces: it never exists outside them
    ip link add $3 netns $A type veth peer name $3 netns $B || exit 1
    ip -n $A addr add $IPA/24 dev $3 && ip -n $B addr add $IPB/24 dev $3 || exit 1
    for n in $A $B; do ip -n $n link set lo up && ip -n $n link set $3 up || exit 1; done
}

two_hosts_cleanup() {
    for p in $pids; do kill -KILL "$p" 2> /dev/null; done
    for n in $A $B; do # whatever still runs in a host
        for p in $(ip netns pids $n 2> /dev/null); do kill -KILL "$p" 2> /dev/null; done
        ip netns del $n 2> /dev/null
    done
    rm -rf "$work"
}

# in_host NS COMMAND...: COMMAND inside the host NS, with its own host name
in_host() {
    ns=$1
    shift
    ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec "$@"' "host-$ns" "$@"
}
