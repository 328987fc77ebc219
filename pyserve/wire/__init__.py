"""Typed messages of the three one-way ZMQ channels (DESIGN.md, "Processes and channels").

One module a channel, imported by both of its ends: ``main_to_worker``, ``worker_to_detok``,
``detok_to_main``. Every message is a tagged msgspec Struct encoded as msgpack; arrays travel as
packed little-endian bytes. Nothing is ever pickled.
"""
