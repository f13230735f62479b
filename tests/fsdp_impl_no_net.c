/* The implementation built as an engine that wants no sockets builds it
   (FSDP_NO_NET): for tests/test_no_net.c and the tests that need no
   network, linked against it (tests/meson.build, suite no_net). */
#define FSDP_NO_NET
#define FSDP_IMPLEMENTATION
#include "fsdp.h"
