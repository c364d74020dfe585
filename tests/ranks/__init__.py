"""What a rank runs in the multi-process tests (tests/multiproc, tests/netns, tests/verbs): workers, scripts and
their supervisors, apart from the tests themselves."""
