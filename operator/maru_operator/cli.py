"""``maru-operator run`` (the controller), ``render`` (offline manifests), ``validate`` and ``rbac``."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys
from collections.abc import Callable, Sequence

from maru_operator import __version__
from maru_operator.builders.netpol import NetworkPolicyConfig
from maru_operator.cache import RESYNC_SECONDS
from maru_operator.images import ImageDefaults
from maru_operator.rollouts import DEFAULT_MAX_GROUPS
from maru_operator.traffic import DEFAULT_WINDOW_S

log = logging.getLogger("maru_operator")


# What every LogRecord carries; anything else on a record came from a call's ``extra`` (the object, the reason).
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        import json

        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(
            {
                k: v
                for k, v in vars(record).items()
                if k not in _RECORD_ATTRIBUTES and k not in entry and isinstance(v, str | int | float | bool)
            }
        )
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _network_policy_flags(parser: argparse.ArgumentParser) -> None:
    """The cluster facts the children's NetworkPolicies need (see builders/netpol.py)."""
    parser.add_argument(
        "--network-policies",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write a NetworkPolicy for every pool daemon and serving pod (default: on)",
    )
    parser.add_argument(
        "--scrape-namespace",
        action="append",
        default=[],
        metavar="NAMESPACE",
        help="pods in this namespace may scrape the metrics ports, e.g. monitoring (repeatable)",
    )
    parser.add_argument(
        "--api-server-cidr",
        action="append",
        default=[],
        metavar="CIDR",
        help="where the routers reach the API server (repeatable; default 0.0.0.0/0 and ::/0)",
    )
    parser.add_argument(
        "--api-server-port",
        action="append",
        default=[],
        type=int,
        metavar="PORT",
        help="API server port after the Service's translation (repeatable; default 443 and 6443)",
    )


def network_policy_config(args: argparse.Namespace, operator_namespace: str | None = None) -> NetworkPolicyConfig:
    defaults = NetworkPolicyConfig()
    return NetworkPolicyConfig(
        enabled=args.network_policies,
        operator_namespace=operator_namespace,
        scrape_namespaces=tuple(args.scrape_namespace),
        api_server_cidrs=tuple(args.api_server_cidr) or defaults.api_server_cidrs,
        api_server_ports=tuple(args.api_server_port) or defaults.api_server_ports,
    )


def _checked(check: Callable[[str], str]) -> Callable[[str], str]:
    """An argparse type from a check that raises ValueError naming the rule."""

    def parse(text: str) -> str:
        try:
            return check(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return parse


def _image_flags(parser: argparse.ArgumentParser) -> None:
    """The images of MaruPools and InferenceGroups that name none (see maru_operator/images.py)."""
    from maru_operator import images

    parser.add_argument(
        "--image-registry",
        default=images.DEFAULT_REGISTRY,
        type=_checked(images.check_registry),
        metavar="REGISTRY",
        help=f"registry and path of the default pool, vLLM and router images (default: {images.DEFAULT_REGISTRY})",
    )
    parser.add_argument(
        "--image-tag",
        default=images.DEFAULT_IMAGES.tag,
        type=_checked(images.check_tag),
        help="tag of the default pool and vLLM images (default: the operator's version, "
        f"{images.DEFAULT_IMAGES.tag}); the router image keeps its own",
    )
    for name, derived in (
        ("pool", f"<registry>/{images.POOL_NAME}:<tag>"),
        ("vllm", f"<registry>/{images.VLLM_NAME}:<tag>"),
        ("router", f"<registry>/{images.ROUTER_NAME}:{images.ROUTER_VERSION}"),
    ):
        parser.add_argument(
            f"--{name}-image",
            default=None,
            type=_checked(images.check_reference),
            metavar="IMAGE",
            help=f"the whole default {name} image, instead of {derived}",
        )


def image_defaults(args: argparse.Namespace) -> ImageDefaults:
    return ImageDefaults(
        registry=args.image_registry,
        tag=args.image_tag,
        pool=args.pool_image or "",
        vllm=args.vllm_image or "",
        router=args.router_image or "",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="maru-operator", description="Maru P/D operator")
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the operator against the cluster in the kubeconfig (or in-cluster)")
    scope = run.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch InferenceGroups in this namespace (repeatable); default: all namespaces",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (default)")
    run.add_argument(
        "--pool-namespace",
        default=None,
        help="namespace of the pool daemons (default: $POD_NAMESPACE, else maru-system)",
    )
    run.add_argument(
        "--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint URL; empty to disable"
    )
    run.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port; 0 to disable")
    run.add_argument("--workers", type=int, default=8, help="objects reconciled at once")
    run.add_argument(
        "--resync-seconds",
        type=float,
        default=RESYNC_SECONDS,
        help=f"check the cache against fresh lists and look at every owner this often (default: {RESYNC_SECONDS:.0f})",
    )
    run.add_argument(
        "--max-rolling-groups",
        type=int,
        default=DEFAULT_MAX_GROUPS,
        help="groups whose vLLM pods roll out at once; a pod template change of another waits "
        "(an operator upgrade then restarts the fleet a few groups at a time); a group annotated "
        "maru.io/rollout-pacing=off is never held and holds no slot; 0: no bound",
    )
    run.add_argument(
        "--data-plane-updates",
        choices=("manual", "auto"),
        default="manual",
        help="manual (default): a pool or group keeps the default images it runs when this operator's "
        "defaults change (an upgrade), until annotated maru.io/data-plane-updates=auto; auto: "
        "every one moves (groups paced by --max-rolling-groups)",
    )
    run.add_argument(
        "--read-pods",
        action="store_true",
        help="read the pods of a role that is not ready, so the group's Ready message says why (unschedulable, "
        "image pull, crash loop); needs get/list on pods (the chart's readPods grants it); off: the Deployment's "
        "conditions only",
    )
    run.add_argument(
        "--pool-usage-interval",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="write a pool's memory use (which changes with traffic) to its status at most this "
        "often; condition changes are written at once",
    )
    run.add_argument(
        "--disaggregation-window",
        type=_window_seconds,
        default=DEFAULT_WINDOW_S,
        metavar="SECONDS",
        help="how far back a group's DisaggregationActive condition looks at the pool daemons' decode "
        "counters (default: %(default).0f); it compares polls --pool-usage-interval apart, so "
        "make it several of them",
    )
    run.add_argument(
        "--standalone",
        action="store_true",
        default=True,
        help="kopf without its peering (always; replicas elect a leader with a Lease instead)",
    )
    run.add_argument(
        "--instance",
        default="",
        type=_instance_name,
        help="serve only MaruPools and InferenceGroups labelled maru.io/operator-instance=NAME "
        "(default: only those without the label); every installation needs its own",
    )
    run.add_argument(
        "--no-leader-election",
        dest="leader_election",
        action="store_false",
        help="reconcile without holding the leader Lease (only ever with exactly one replica)",
    )
    run.add_argument(
        "--lease-namespace",
        default=None,
        help="namespace of the leader Lease (default: default); the same for every installation in "
        "the cluster, so two that serve the same instance by mistake never both reconcile",
    )
    run.add_argument(
        "--lease-seconds", type=float, default=15.0, help="a leader not heard from for this long is replaced"
    )
    run.add_argument(
        "--renew-deadline",
        type=float,
        default=10.0,
        help="a leader that cannot renew its Lease for this long stops reconciling",
    )
    run.add_argument("--retry-period", type=float, default=2.0, help="how often the Lease is renewed or tried")
    run.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    run.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="json: one JSON object per line, for log collectors",
    )
    _network_policy_flags(run)
    _image_flags(run)

    render = sub.add_parser("render", help="print the child manifests for MaruPool/InferenceGroup files")
    render.add_argument(
        "-f", "--filename", action="append", required=True, help="a YAML file or a directory of them (repeatable)"
    )
    render.add_argument("--pool-namespace", default=None, help="namespace of the pool daemons")
    _network_policy_flags(render)
    _image_flags(render)

    validate = sub.add_parser(
        "validate",
        help="check MaruPool/InferenceGroup files as the API server and the operator would, offline",
        description="Check MaruPools and InferenceGroups against the CRDs' schema and rules, the operator's own "
        "checks, and each other (a group's poolRef, the pool's allowedNamespaces). One line per "
        "document: ok, error, note (not checked, and why) or skip (another kind). Exit 0: every "
        "object is valid; 1: an error, or nothing to check; 2: a file that does not exist.",
    )
    validate.add_argument(
        "-f",
        "--filename",
        action="append",
        required=True,
        help="a YAML file, a directory of them (*.yaml, *.yml; not recursive) or - for standard "
        "input (repeatable; objects given together are checked against each other)",
    )

    rbac = sub.add_parser("rbac", help="print the ClusterRole and the pool namespace's Role the operator needs")
    rbac.add_argument("--name", default="maru-operator", help="name of the ClusterRole and the Role")
    rbac.add_argument("--namespaced", action="store_true", help="the rules for a run with --namespace")
    rbac.add_argument(
        "--pool-namespace",
        default=None,
        help="where the Role goes: the pool daemons' namespace (default: $POD_NAMESPACE, else maru-system)",
    )
    rbac.add_argument("--lease-namespace", default=None, help="where the leader Lease's Role goes (default: default)")
    rbac.add_argument(
        "--instance",
        default="",
        type=_instance_name,
        help="the operator instance (run --instance): the leader Lease its Role names",
    )
    rbac.add_argument(
        "--service-account", default=None, help="also print the bindings to this ServiceAccount (in the pool namespace)"
    )
    return parser


def _window_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 10 <= value <= 86_400:
        raise argparse.ArgumentTypeError(f"{text!r}: the window is a number of seconds from 10 to 86400")
    return value


def _instance_name(text: str) -> str:
    import re

    if text and not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?", text):
        raise argparse.ArgumentTypeError(
            f"{text!r}: an instance name is a DNS label of at most 40 characters (it names the Lease too)"
        )
    return text


# The young generation's threshold: a watch event parses into hundreds of dicts, so at the default (700) a
# collection ran on nearly every event; most objects die young either way.
GC_YOUNG_THRESHOLD = 20_000


def tune_gc() -> None:
    """Before the operator's loop starts: what was imported (kopf, pydantic, the clients) is never garbage, so it is
    moved out of the collector's sight (gc.freeze), and young collections run less often. At a thousand groups
    the collector's passes were a tenth of the operator's CPU time."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "render":
        return _render(args)
    if args.command == "validate":
        return _validate(args)
    if args.command == "rbac":
        return _rbac(args)
    return _run(args)


def _rbac(args: argparse.Namespace) -> int:
    import yaml

    from maru_operator.handlers import default_pool_namespace
    from maru_operator.rbac import (
        DEFAULT_LEASE_NAMESPACE,
        LEASE_NAMESPACE_RULES,
        POOL_NAMESPACE_RULES,
        bindings,
        cluster_role,
        lease_namespace_role,
        pool_namespace_role,
        router_cluster_role,
        rules,
    )

    namespace = args.pool_namespace or default_pool_namespace()
    lease_namespace = args.lease_namespace or DEFAULT_LEASE_NAMESPACE
    for title, scoped in (
        ("ClusterRole", rules(args.namespaced, args.instance)),
        (f"Role in {namespace}", POOL_NAMESPACE_RULES),
        (f"Role in {lease_namespace}", LEASE_NAMESPACE_RULES),
    ):
        print(f"# {title}:")
        for groups, resources, verbs, why in scoped:
            print(f"#   {', '.join(resources)} ({', '.join(g or 'core' for g in groups)}): {', '.join(verbs)}: {why}")
    objects = [
        cluster_role(args.name, args.namespaced, args.instance),
        pool_namespace_role(namespace, args.name),
        lease_namespace_role(lease_namespace, args.name, args.instance),
    ]
    if args.service_account:
        objects += bindings(namespace, args.service_account, args.name, lease_namespace)
    # Not bound to the operator: it binds this one to each router (the routers' pod discovery).
    objects.append(router_cluster_role(args.instance))
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
    return 0


def _render(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from maru_operator.handlers import default_pool_namespace
    from maru_operator.render import RenderError, render

    try:
        sys.stdout.write(
            render(
                args.filename,
                args.pool_namespace or default_pool_namespace(),
                network_policy_config(args),
                image_defaults(args),
            )
        )
    except (OSError, ValidationError, RenderError) as err:
        print(f"maru-operator render: {err}", file=sys.stderr)
        return 1
    return 0


def _validate(args: argparse.Namespace) -> int:
    from maru_operator.validatecli import run

    return run(args.filename)


def _run(args: argparse.Namespace) -> int:
    import kopf

    from maru_operator import handlers, metrics
    from maru_operator.crdcheck import check_crds
    from maru_operator.kube import Kube, login
    from maru_operator.rbac import DEFAULT_LEASE_NAMESPACE

    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter()
        if args.log_format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, handlers=[handler])
    # kopf's per-event debug lines drown ours at scale.
    logging.getLogger("kopf").setLevel(logging.INFO if args.verbose else logging.WARNING)
    pool_namespace = args.pool_namespace or handlers.default_pool_namespace()
    try:
        connection = login()
    except Exception as err:  # any login failure is a start-up error
        print(f"maru-operator: cannot log in to Kubernetes: {err}", file=sys.stderr)
        return 1
    namespaces = list(args.namespace)

    async def preflight() -> None:
        async with Kube(connection, timeout=10) as kube:
            await kube.preflight(namespaces[0] if namespaces else None)
            # A stale CRD is reported, not fatal: the objects it still describes keep being served.
            await check_crds(kube)

    try:
        asyncio.run(preflight())
    except SystemExit as err:
        print(f"maru-operator: {err}", file=sys.stderr)
        return 1

    if args.metrics_port:
        metrics.serve(args.metrics_port)
    if namespaces and pool_namespace not in namespaces:
        # The pools' daemons live there; without watching it the operator could not see them.
        namespaces.append(pool_namespace)
    runtime = handlers.configure(
        handlers.Config(
            pool_namespace=pool_namespace,
            workers=args.workers,
            resync_seconds=args.resync_seconds,
            usage_interval=args.pool_usage_interval,
            instance=args.instance,
            disaggregation_window=args.disaggregation_window,
            leader_election=args.leader_election,
            lease_namespace=args.lease_namespace or DEFAULT_LEASE_NAMESPACE,
            lease_seconds=args.lease_seconds,
            renew_deadline=args.renew_deadline,
            retry_period=args.retry_period,
            connection=connection,
            namespaces=namespaces,
            network=network_policy_config(args, handlers.operator_namespace()),
            images=image_defaults(args),
            max_rolling_groups=args.max_rolling_groups,
            data_plane_updates=args.data_plane_updates,
            read_pods=args.read_pods,
        )
    )
    if args.renew_deadline >= args.lease_seconds or args.retry_period >= args.renew_deadline:
        print("maru-operator: need --retry-period < --renew-deadline < --lease-seconds", file=sys.stderr)
        return 2
    log.info(
        "starting maru-operator %s against %s (%s)",
        __version__,
        connection.server,
        "namespaces " + ", ".join(namespaces) if namespaces else "all namespaces",
    )
    images = image_defaults(args)
    log.info(
        "default images (for objects that name none): pool %s, vllm %s, router %s",
        images.pool_image,
        images.vllm_image,
        images.router_image,
    )
    tune_gc()
    asyncio.run(
        kopf.operator(
            standalone=True,
            clusterwide=not namespaces,
            namespaces=namespaces,
            liveness_endpoint=args.liveness or None,
            memo=handlers.memo(runtime),
        )
    )
    return 0
