#!/bin/sh
# Installs what building and testing fsdp.h needs, only when it is missing:
# meson, ninja, a C and a C++ compiler, clang (the tests build with both).
# Safe to run any number of times.
set -e
need=""
command -v meson >/dev/null 2>&1 || need="$need meson"
command -v ninja >/dev/null 2>&1 || need="$need ninja-build"
command -v cc >/dev/null 2>&1 || need="$need gcc"
command -v c++ >/dev/null 2>&1 || need="$need g++"
command -v clang >/dev/null 2>&1 || need="$need clang"
command -v pkg-config >/dev/null 2>&1 || need="$need pkg-config"
if [ -n "$need" ]; then
    echo "deps: installing$need"
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $need >/dev/null
fi
