#!/bin/sh
# FSDP_NO_NET compiles every socket of fsdp.h out. Checks, on the objects
# this build made of the implementation (tests/fsdp_impl.c, and
# tests/fsdp_impl_no_net.c with FSDP_NO_NET):
#   - the no-net object references no socket call (and the default one
#     does, so that the check can fail);
#   - in src/, only the >>launch parts mention FSDP_NO_NET or FSDP__NET, so
#     every other section compiles the same with it (the other tests of
#     suite no_net run on the no-net implementation).
# usage: check_no_net.sh SRCDIR DEFAULT.a NO_NET.a
set -u
src=$1 def=$2 nonet=$3
fail=0
calls='socket|connect|bind|listen|accept|accept4|getaddrinfo|freeaddrinfo|setsockopt|getsockopt|getsockname|getpeername|send|recv|sendto|recvfrom|sendmsg|recvmsg|shutdown|poll|inet_pton|inet_ntop'
undef() { nm -u "$1" 2>/dev/null | awk '{print $NF}' | sed 's/@.*//' | grep -E "^($calls)\$" | sort -u; }
have=$(undef "$def" | tr '\n' ' ')
none=$(undef "$nonet" | tr '\n' ' ')
echo "default implementation calls: ${have:-nothing}"
echo "FSDP_NO_NET implementation calls: ${none:-nothing}"
if [ -z "$have" ]; then
    echo "FAIL: the default implementation references no socket call: this check sees nothing"
    fail=1
fi
if [ -n "$none" ]; then
    echo "FAIL: built with FSDP_NO_NET, the implementation still references: $none"
    fail=1
fi
out=$(grep -l '^ *#.*FSDP_NO_NET\|^ *#.*FSDP__NET' "$src"/src/*.c "$src"/src/*.h | grep -v '/src/launch[^/]*$')
if [ -n "$out" ]; then
    echo "FAIL: parts outside >>launch depend on FSDP_NO_NET: $out"
    fail=1
fi
[ "$fail" = 0 ] && echo "no_net: ok"
exit $fail
