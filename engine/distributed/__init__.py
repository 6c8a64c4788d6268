"""Multi-process engine: one worker process per device, each data-parallel rank its own batch.

``topology`` (which processes run which rank, which ranks step together), ``protocol`` (the
messages between rank 0 and the workers, and their link), ``rendezvous`` (who is who, process
groups), ``worker`` (the loop of ranks 1..N-1), ``executor`` (rank 0's side: spawns or joins
the workers and runs steps), ``ports`` (free ports for servers a benchmark or test starts).
"""
