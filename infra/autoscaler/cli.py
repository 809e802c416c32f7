"""`ferry autoscale`: size GPU worker pools from Redis backlog where KEDA is not available."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time

from ferry.autoscaler.settings import AutoscalerSettings, parse_pairs

log = logging.getLogger("ferry.autoscale")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ferry autoscale",
        description="Publish the desired worker count per model (Prometheus, CloudWatch) from Redis "
        "stream lag, pending jobs and live workers; optionally set an ASG or ECS service to it. "
        "Configuration: FERRY_* environment variables (infra/autoscaler/settings.py).",
    )
    p.add_argument("--once", action="store_true", help="one tick, print the decisions, exit")
    p.add_argument("--dry-run", action="store_true", help="decide and serve /metrics, call no AWS API")
    p.add_argument("--record", metavar="CSV", help="append every observation and decision to this file")
    p.add_argument(
        "--simulate",
        metavar="TRACE",
        help="no Redis: replay a job trace (CSV arrival_s,service_s, or burst|diurnal|trickle) "
        "through the configured policy and print cost, cold starts and flaps",
    )
    p.add_argument("--boot-s", type=float, default=120.0, help="--simulate: seconds from ask to ready")
    p.add_argument("--concurrency", type=int, default=8, help="--simulate: jobs one worker runs at once")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = AutoscalerSettings()
    if args.simulate:
        return _simulate(args, settings)
    loop = _build_loop(settings, dry_run=args.dry_run, record=args.record)
    if args.once:
        for model, d in loop.tick(time.monotonic()).items():
            print(f"{model}: desired={d.desired} recommended={d.recommended} ({d.reason})")
        return 0

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if settings.autoscale_metrics_port:
        from prometheus_client import start_http_server

        start_http_server(
            settings.autoscale_metrics_port,
            settings.autoscale_metrics_host,
            registry=loop.publishers[0].registry,
        )
    log.info("autoscaling %s every %.0fs", ", ".join(loop.models), settings.autoscale_interval_s)
    while not stop.is_set():
        started = time.monotonic()
        try:
            loop.tick(started)
        except Exception:  # Redis or AWS hiccup: keep the last decision, try again next tick
            log.exception("tick failed")
        stop.wait(max(0.0, settings.autoscale_interval_s - (time.monotonic() - started)))
    return 0


def _build_loop(settings: AutoscalerSettings, *, dry_run: bool, record: str | None):
    from ferry.autoscaler.loop import AutoscaleLoop
    from ferry.autoscaler.publish import AsgActuator, CloudWatchPublisher, EcsActuator, PrometheusGauges
    from ferry.autoscaler.redis_source import RedisBacklog
    from ferry.worker.common.connect import connect

    client = connect(settings.redis_url, cluster=settings.redis_cluster, decode_responses=True,
                     socket_connect_timeout=2.0, socket_timeout=5.0)
    publishers: list = [PrometheusGauges()]
    actuators: list = []
    if not dry_run:
        aws = _aws_clients(settings)
        if settings.autoscale_cloudwatch_namespace:
            publishers.append(CloudWatchPublisher(aws("cloudwatch"), settings.autoscale_cloudwatch_namespace))
        if asgs := parse_pairs(settings.autoscale_asg_names):
            actuators.append(AsgActuator(aws("autoscaling"), asgs))
        if services := parse_pairs(settings.autoscale_ecs_services):
            actuators.append(EcsActuator(aws("ecs"), services))
    return AutoscaleLoop(
        source=RedisBacklog(client, settings.key_prefix, settings.queue_shards),
        policy=settings.policy(),
        models=settings.models(),
        publishers=publishers,
        actuators=actuators,
        record_to=open(record, "a", encoding="utf-8") if record else None,  # noqa: SIM115 - lives as long as the process
    )


def _aws_clients(settings: AutoscalerSettings):
    import boto3

    session = boto3.session.Session(region_name=settings.autoscale_aws_region)
    return lambda service: session.client(service, endpoint_url=settings.autoscale_aws_endpoint_url)


def _simulate(args: argparse.Namespace, settings: AutoscalerSettings) -> int:
    from ferry.autoscaler import simulate as sim

    builtin = {"burst": sim.burst_trace, "diurnal": sim.diurnal_trace, "trickle": sim.trickle_trace}
    jobs = builtin[args.simulate]() if args.simulate in builtin else sim.load_jobs_csv(args.simulate)
    if not jobs:
        print("empty trace", file=sys.stderr)
        return 2
    pool = sim.PoolModel(boot_s=args.boot_s, concurrency=args.concurrency, tick_s=settings.autoscale_interval_s)
    horizon = max(j.arrival_s + j.service_s for j in jobs) + args.boot_s + settings.autoscale_max_idle_to_zero_s * 2
    print(sim.simulate(jobs, settings.policy(), pool, horizon).summary())
    return 0
