"""The CSI node plugin ``csi.maru.io``: hands a pool's node-local socket directory to pods.

vLLM pods reach the pool daemon through a Unix socket on their node. Instead of a ``hostPath`` volume,
which Pod Security ``baseline`` and ``restricted`` forbid, a pod names an inline ephemeral CSI volume of
this driver; the kubelet asks the plugin to publish it, and the plugin bind-mounts the pool's socket
directory, read-only, at the pod's volume path. The plugin is infrastructure: it runs privileged on
every node, from the pool image; the pods that use it stay unprivileged.

``contract``: the driver name and volume attributes (no gRPC: the operator imports it).
``admission``: which pods a pool admits, the file its agent writes beside the socket (no gRPC either).
``node``: the Identity and Node services. ``mounts``: bind mounts and /proc/self/mountinfo.
``server``: the process (``maru-csi``). ``csi.proto`` and the generated ``csi_pb2*``: the CSI messages.
"""
