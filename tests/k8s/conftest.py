from tests.k8s.fixtures import k8s_emulator, kube_controllers

__all__ = ["k8s_emulator", "kube_controllers"]
