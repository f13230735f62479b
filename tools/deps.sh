#!/bin/sh
# Installs what building and testing fsdp.h needs, only when it is missing:
# meson, ninja, a C and a C++ compiler, clang (the tests build with both),
# python3 with venv (the GPU rehearsal), and the optional backends'
# dependencies: Open MPI (libopenmpi-dev, openmpi-bin) and Gloo
# (libgloo-dev). Safe to run any number of times.
set -e
need=""
command -v meson >/dev/null 2>&1 || need="$need meson"
command -v ninja >/dev/null 2>&1 || need="$need ninja-build"
command -v cc >/dev/null 2>&1 || need="$need gcc"
command -v c++ >/dev/null 2>&1 || need="$need g++"
command -v clang >/dev/null 2>&1 || need="$need clang"
command -v pkg-config >/dev/null 2>&1 || need="$need pkg-config"
command -v cmake >/dev/null 2>&1 || need="$need cmake"  # tests/check_consumers.sh's CMake route
# tools/gpu.sh --rehearse: a virtual environment for the NCCL and cuBLAS wheels
if ! command -v python3 >/dev/null 2>&1; then
    need="$need python3 python3-venv"
elif ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    need="$need python3-venv"
fi
if [ -n "$need" ]; then
    echo "deps: installing$need"
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $need >/dev/null
fi

# The MPI and Gloo backends are optional (meson turns them off when their
# dependency is missing), so failing to install them is a warning, not an error.
opt=""
# the headers: mpicc comes with openmpi-bin, mpi.h with libopenmpi-dev
pkg-config --exists ompi-c 2>/dev/null || opt="$opt libopenmpi-dev"
command -v mpiexec >/dev/null 2>&1 || opt="$opt openmpi-bin"
[ -f /usr/include/gloo/allgather.h ] || opt="$opt libgloo-dev"
if [ -n "$opt" ]; then
    echo "deps: installing$opt"
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO=sudo
    { $SUDO apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $opt >/dev/null; } ||
        echo "deps: could not install$opt; the MPI/Gloo backends and their tests are skipped"
fi
