"""``pcr``: the command line of the prefix-cache registry (simulate, stats, inspect,
match, watch, gc, bench). Imports ``sim``, ``gpu`` and ``registry``; nothing imports it."""
