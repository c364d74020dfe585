// The C++ unit tests of the engine core (doctest), run by ctest.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
