"""The CSI node driver (``spokefs csi``): Kubernetes pods get datasets as volumes.

``messages`` builds the CSI messages (csi.v1, the subset in ``csi.proto``); ``service`` serves
the Identity and Node services over gRPC on a unix socket; ``volumes`` runs one mount process
per published volume and remembers them in a state folder, so a restarted driver finds them.
Needs grpcio and protobuf (the ``csi`` extra).
"""
