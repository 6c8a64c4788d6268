"""Multi-process engine: one worker process per device, data-parallel ranks in step waves.

``rendezvous`` (who is who, process groups), ``worker`` (the loop of ranks 1..N-1),
``executor`` (rank 0's side: spawns or joins the workers and runs waves).
"""
