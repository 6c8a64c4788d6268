"""The ``ditserve`` command line, a thin shell over the engine.

``main`` parses the subcommands (generate, demo, serve, model ...) and calls one library
function each; ``options`` is the flag table shared by generate, serve and demo (flags ->
``EngineConfig``; the operator reads it to judge a spec's engine arguments, so it imports
nothing heavy); ``generate`` runs one request to a file. The package's ``__init__`` imports
nothing, so reading the flag table never loads the engine.
"""
