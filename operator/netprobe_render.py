"""The network probe's objects (operator/netprobe.py; docs/network.md): a headless Service for
the ranks' rendezvous and the probe pods, built like every GPU pod of the job (render.gpu_pod:
its image, security context, podTemplate, resources, tolerations, gang membership)."""

from __future__ import annotations

from typing import Any

from cephalo.api import CephaloJob
from cephalo.api.trainer_env import TrainerVars
from cephalo.operator.config import OperatorConfig
from cephalo.operator.gang import apply_gang
from cephalo.operator.podspec import (
    CPUS_PER_RANK,
    apply_default_resources,
    apply_pod_template,
    host_memory_bytes,
)
from cephalo.operator.render import (
    ANNOTATION_CONFIG_HASH,
    CONFIG_DIR,
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_NETPROBE,
    LABEL_PRODUCT,
    LABEL_ROLE,
    TERMINATION_MESSAGE_PATH,
    dns_safe,
    gpu_pod,
    job_name,
    object_meta,
    pod_env,
    pool_selector,
    spec_config_map_name,
)


def netprobe_service_name(job: CephaloJob) -> str:
    return f"{job_name(job)}-netprobe"  # at most 47 + 9 characters: a DNS label


def render_netprobe(job: CephaloJob, probe: str, pools: list[str], join_timeout_seconds: float,
                    config: OperatorConfig | None = None) -> list[dict[str, Any]]:
    """The network probe `probe` (a short digest) of this job (operator/netprobe.py): its
    headless Service, then its pods. Two pools: one pod on a node of each (different nodes:
    anti-affinity on the probe's label), a gang of two; one pool: one pod with two GPUs of
    one node, running both ranks."""
    config = config or OperatorConfig()
    intra = len(pools) == 1
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": object_meta(job, netprobe_service_name(job), {LABEL_ROLE: "netprobe"}),
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                        "selector": {LABEL_JOB: job_name(job), LABEL_ROLE: "netprobe"},
                        "ports": [{"name": "rendezvous", "port": config.master_port,
                                   "targetPort": config.master_port}]}}
    master = f"netprobe-{probe}-0.{netprobe_service_name(job)}.{job.metadata.namespace}.svc"
    pods = []
    for index, pool in enumerate(pools):
        env = pod_env(TrainerVars(
            rank=index, world_size=2, local_rank=0, master_addr=master,
            master_port=config.master_port, job=f"{CONFIG_DIR}/job.yaml",
            collective_timeout_seconds=join_timeout_seconds,
            ranks_per_pod=2 if intra else None, termination_log=TERMINATION_MESSAGE_PATH))
        pod = gpu_pod(
            job, config, name=f"{job_name(job)}-netprobe-{probe}-{index}",
            labels={LABEL_ROLE: "netprobe", LABEL_NETPROBE: probe, LABEL_ATTEMPT: "0",
                    LABEL_PRODUCT: dns_safe(pool, 63)},
            annotations={ANNOTATION_CONFIG_HASH: probe}, product=pool,
            command=["python", "-m", "cephalo.trainer.netprobe"], env=env,  # output: the
            # termination log CEPHALO_TERMINATION_LOG names, as a rank pod's
            config_map=spec_config_map_name(job),
            ports=[{"name": "rendezvous", "containerPort": config.master_port}],
            extra_volumes=[], extra_mounts=[], node_selector=pool_selector(job, pool),
            gpus=2 if intra else 1)
        pod["spec"]["hostname"] = f"netprobe-{probe}-{index}"
        pod["spec"]["subdomain"] = netprobe_service_name(job)
        pod = apply_default_resources(apply_pod_template(pod, job.spec.pod_template),
                                      host_memory_bytes(None, [1.0]),
                                      CPUS_PER_RANK * (2 if intra else 1))
        if not intra:  # the two ranks on two nodes, whatever their pools (after the
            # template: its node affinity is kept, this anti-affinity is the probe's own)
            pod["spec"].setdefault("affinity", {})["podAntiAffinity"] = {
                "requiredDuringSchedulingIgnoredDuringExecution": [{
                    "labelSelector": {"matchLabels": {LABEL_NETPROBE: probe}},
                    "topologyKey": "kubernetes.io/hostname"}]}
        pods.append(apply_gang(pod, job, group=f"{job_name(job)}-np-{probe}",
                               group_size=len(pools), task=dns_safe(pool, 63)))
    return [service, *pods]


__all__ = ["netprobe_service_name", "render_netprobe"]
