"""The keys an elastic job's launcher (its agent, :mod:`rdkeras.launch_agent`) and its workers' group
(:mod:`rdkeras.elastic.group`) speak in a generation's store, the lobby and generation 0's store."""

READY = "elastic/ready/"
NEXT = "elastic/next"
JOINERS = "elastic/joiners"  # set by the agent in the current store while replacements wait in the lobby
JOINING = "joining/"  # lobby: a replacement is there (its id)
ADMIT = "admit/"  # lobby: the group it joins (the NEXT of that re-forming), or an error
FIRST_STEP = "elastic/first-step"  # set by the new group's rank 0 after its first step (wall-clock time)
EXITED = "elastic/exited/"  # generation 0's store: another node's launcher saw worker ID exit (its return code)
ENDED = "elastic/ended"  # generation 0's store: the job ends (the error), for the other nodes' launchers
