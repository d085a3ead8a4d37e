"""A spoke tier: several spokes in one region share one cache.

Each block (file version, block index) has one owner among the members, chosen by rendezvous
(highest-random-weight) hashing, and an ordered list of fallbacks after it
(``rendezvous``). Which members are listed comes from a source (``sources``: a static list,
DNS, the Kubernetes EndpointSlice API); whether a listed member is answering is tracked from
the outcome of the requests sent to it (``membership``). The modules here do no I/O except
the thin look-up functions in ``sources``; the spoke's data path drives them.
"""
