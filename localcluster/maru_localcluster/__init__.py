"""A local Kubernetes cluster on one machine, for the demo and the tests.

``apiserver``: an API server emulator on loopback HTTP. ``server``: runs it in a thread and drives it
synchronously. ``simcontrollers``: writes workload status as controllers would, without running pods.
``tools``: the real kubectl and helm binaries. Nothing in the product (operator, connector) imports this.
"""
