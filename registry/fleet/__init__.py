"""The fleet as a router sees it: the node index of leases, the engine table and
collecting dead namespaces (``membership``), and ``registry.fleet.view.FleetView``, which
namespaces hold each block hash, kept in the router's own memory and fed by the change
records every write script publishes on its namespace's channel (``lua/_prelude.lua``
``record_changes``). Redis stays the durable truth and the cold-start source; a router
without a view scores exactly, per namespace (``registry.routing``).
"""
