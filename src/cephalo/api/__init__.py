"""Typed contracts shared by every Cephalo component (torch-free, Kubernetes-free)."""

from cephalo.api.cluster import ClusterSpec, GpuGroup
from cephalo.api.job import (
    API_GROUP,
    API_VERSION,
    KIND,
    PLURAL,
    CephaloJob,
    CephaloJobSpec,
    CephaloJobStatus,
    Condition,
    JobFileError,
    ModelSpec,
    load_job,
    parse_job,
)
from cephalo.api.models import PRESETS, ModelConfig, preset
from cephalo.api.plan import BaselineResult, Plan, PlanError, RankPlan, load_plan, parse_plan
from cephalo.api.profile import CollectiveProfile, GpuProfile, ProfilePoint
from cephalo.api.sharding import shard_bounds

__all__ = [
    "API_GROUP", "API_VERSION", "KIND", "PLURAL", "PRESETS", "BaselineResult", "CephaloJob",
    "CephaloJobSpec", "CephaloJobStatus", "ClusterSpec", "CollectiveProfile", "Condition",
    "GpuGroup", "GpuProfile", "JobFileError", "ModelConfig", "ModelSpec", "Plan", "PlanError",
    "ProfilePoint", "RankPlan", "load_job", "load_plan", "parse_job", "parse_plan", "preset",
    "shard_bounds",
]
