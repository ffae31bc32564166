"""The emulator itself: the kube-apiserver behaviours the operator tests rely on."""

from __future__ import annotations

import asyncio
import json

import pytest
from kube_emulator import ApiEmulator
from kube_selectors import match_labels, strategic_merge
from kubelet import wait_for

pytestmark = pytest.mark.asyncio

NS_PODS = "/api/v1/namespaces/default/pods"
JOBS = "/apis/cephalo.dev/v1alpha1/namespaces/default/cephalojobs"


async def _json(resp) -> dict:
    async with resp as r:
        return {**json.loads(await r.read()), "http": r.status}


async def _post(api: ApiEmulator, url: str, body: dict) -> dict:
    return await _json(api.post(url, json=body))


async def _patch(api: ApiEmulator, url: str, body, ctype: str = "merge-patch+json") -> dict:
    return await _json(api.patch(url, data=json.dumps(body),
                                 headers={"Content-Type": f"application/{ctype}"}))


def _pod(name: str, **labels: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "busybox"}]},
            "status": {"phase": "Running"}}


async def test_create_stamps_metadata_and_rejects_duplicates(emulator: ApiEmulator) -> None:
    created = await _post(emulator, NS_PODS, _pod("a"))
    meta = created["metadata"]
    assert created["http"] in (200, 201)
    assert meta["uid"] and meta["creationTimestamp"] and meta["generation"] == 1
    assert int(meta["resourceVersion"]) > 0
    assert created["kind"] == "Pod"
    fetched = await _json(emulator.get(f"{NS_PODS}/a"))
    assert fetched["metadata"]["uid"] == meta["uid"]
    # The API server resets a pod's status on create; only the kubelet (the /status URL) sets it.
    assert fetched["spec"] and fetched["metadata"]["namespace"] == "default"
    assert fetched.get("status", {}).get("phase") == "Pending"
    dup = await _post(emulator, NS_PODS, _pod("a"))
    assert dup["http"] == 409 and dup["code"] == 409
    assert emulator.created("pods") == {("default", "a"): 1}
    gen = await _post(emulator, NS_PODS, {**_pod(""), "metadata": {"generateName": "x-"}})
    assert gen["metadata"]["name"].startswith("x-") and len(gen["metadata"]["name"]) > 2


async def test_status_subresource_rules_and_generation(emulator: ApiEmulator) -> None:
    job = {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
           "metadata": {"name": "j"}, "spec": {"globalBatchSize": 8}, "status": {"phase": "X"}}
    created = await _post(emulator, JOBS, job)
    assert "status" not in created or "phase" not in created.get("status", {})
    # Through the main URL: the status part is ignored, a spec change bumps generation.
    main = await _patch(emulator, f"{JOBS}/j", {"spec": {"globalBatchSize": 16},
                                                "status": {"phase": "Running"}})
    assert main["spec"]["globalBatchSize"] == 16 and main["metadata"]["generation"] == 2
    assert "phase" not in main.get("status", {})
    # Through /status: only the status changes, the generation stays.
    st = await _patch(emulator, f"{JOBS}/j/status", {"spec": {"globalBatchSize": 1},
                                                     "status": {"phase": "Running"}})
    assert st["spec"]["globalBatchSize"] == 16 and st["status"]["phase"] == "Running"
    assert st["metadata"]["generation"] == 2
    assert int(st["metadata"]["resourceVersion"]) > int(main["metadata"]["resourceVersion"])
    # A metadata-only change does not bump the generation either.
    labelled = await _patch(emulator, f"{JOBS}/j", {"metadata": {"labels": {"a": "b"}}})
    assert labelled["metadata"]["generation"] == 2
    stale = await _patch(emulator, f"{JOBS}/j", {"metadata": {"resourceVersion": "1"},
                                                 "spec": {"globalBatchSize": 2}})
    assert stale["http"] == 409


async def test_json_and_strategic_patches(emulator: ApiEmulator) -> None:
    await _post(emulator, NS_PODS, _pod("p"))
    patched = await _patch(emulator, f"{NS_PODS}/p", [
        {"op": "add", "path": "/metadata/annotations", "value": {"x": "1"}}], "json-patch+json")
    assert patched["metadata"]["annotations"] == {"x": "1"}
    sm = await _patch(emulator, f"{NS_PODS}/p", {"spec": {"containers": [
        {"name": "c", "image": "other"}]}}, "strategic-merge-patch+json")
    assert sm["spec"]["containers"] == [{"name": "c", "image": "other"}]
    assert strategic_merge([{"name": "a", "v": 1}], [{"name": "b", "v": 2}]) == [
        {"name": "a", "v": 1}, {"name": "b", "v": 2}]


async def test_label_and_field_selectors(emulator: ApiEmulator) -> None:
    await _post(emulator, NS_PODS, _pod("a", app="x", tier="db"))
    await _post(emulator, NS_PODS, _pod("b", app="y"))
    names = lambda r: sorted(i["metadata"]["name"] for i in r["items"])  # noqa: E731
    listed = await _json(emulator.get(NS_PODS, params={"labelSelector": "app=x"}))
    assert names(listed) == ["a"] and listed["kind"] == "PodList"
    by_set = await _json(emulator.get(NS_PODS, params={"labelSelector": "app in (x,y),!tier"}))
    assert names(by_set) == ["b"]
    by_field = await _json(emulator.get(NS_PODS, params={"fieldSelector": "metadata.name!=a"}))
    assert names(by_field) == ["b"]
    assert names(await _json(emulator.get("/api/v1/pods"))) == ["a", "b"]
    assert not match_labels("a notin (1)", {"a": "1"})
    with pytest.raises(ValueError, match="unable to parse"):
        match_labels("a b", {})


async def _watch(api: ApiEmulator, url: str, params: dict, count: int) -> list[dict]:
    events = []
    async with api.get(url, params={"watch": "true", **params}) as resp:
        async for line in resp.content:
            if line.strip():
                events.append(json.loads(line))
                if len(events) == count:
                    break
    return events


async def test_watch_resumes_from_resource_version_without_replay(emulator: ApiEmulator) -> None:
    a = await _post(emulator, NS_PODS, _pod("a"))
    listed = await _json(emulator.get(NS_PODS))
    since = listed["metadata"]["resourceVersion"]
    assert int(since) >= int(a["metadata"]["resourceVersion"])
    await _post(emulator, NS_PODS, _pod("b"))
    await _patch(emulator, f"{NS_PODS}/a/status", {"status": {"phase": "Running"}})
    events = await asyncio.wait_for(_watch(emulator, NS_PODS, {"resourceVersion": since}, 2), 5)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "b"), ("MODIFIED", "a")]
    # Without a resourceVersion a watch starts with the current state as ADDED events.
    initial = await asyncio.wait_for(_watch(emulator, NS_PODS, {}, 2), 5)
    assert {e["type"] for e in initial} == {"ADDED"}
    # Live events arrive after the stream started, filtered by label.
    task = asyncio.create_task(_watch(emulator, NS_PODS, {
        "resourceVersion": listed["metadata"]["resourceVersion"], "labelSelector": "app=z"}, 1))
    await _post(emulator, NS_PODS, _pod("z", app="z"))
    events = await asyncio.wait_for(task, 5)
    assert events[0]["object"]["metadata"]["name"] == "z"


async def test_watch_timeout_seconds_ends_the_stream(emulator: ApiEmulator) -> None:
    events = await asyncio.wait_for(
        _watch(emulator, NS_PODS, {"resourceVersion": "1", "timeoutSeconds": "1"}, 99), 5)
    assert events == []


async def test_finalizers_and_owner_reference_garbage_collection(emulator: ApiEmulator) -> None:
    job = await _post(emulator, JOBS, {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                                       "metadata": {"name": "j", "finalizers": ["f"]}, "spec": {}})
    owner = [{"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob", "name": "j",
              "uid": job["metadata"]["uid"], "controller": True}]
    pod = _pod("child")
    pod["metadata"]["ownerReferences"] = owner
    await _post(emulator, NS_PODS, pod)
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm",
                                                                "ownerReferences": owner}}
    await _post(emulator, "/api/v1/namespaces/default/configmaps", cm)
    deleting = await _json(emulator.delete(f"{JOBS}/j"))
    assert deleting["metadata"]["deletionTimestamp"]
    assert len(emulator.list_objects("pods")) == 1  # the finalizer holds the owner, and so the GC
    await _patch(emulator, f"{JOBS}/j", {"metadata": {"finalizers": None}})
    assert emulator.list_objects("cephalojobs", group="cephalo.dev") == []
    assert emulator.list_objects("pods") == [] and emulator.list_objects("configmaps") == []


async def test_a_dependent_created_after_its_owner_went_is_collected(
        emulator: ApiEmulator) -> None:
    """The real garbage collector deletes a dependent whose owners are all gone, also one
    created after they went (an operator's write in flight while its job was deleted): the
    API server accepts it, the collector removes it. Only dangling owners count: one live
    owner keeps it."""
    job = await _post(emulator, JOBS, {"apiVersion": "cephalo.dev/v1alpha1",
                                       "kind": "CephaloJob", "metadata": {"name": "j"},
                                       "spec": {}})
    await _json(emulator.delete(f"{JOBS}/j"))

    def owned(name: str, *uids: str) -> dict:
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
            "name": name, "ownerReferences": [
                {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob", "name": "j",
                 "uid": uid} for uid in uids]}}
    live = await _post(emulator, JOBS, {"apiVersion": "cephalo.dev/v1alpha1",
                                        "kind": "CephaloJob", "metadata": {"name": "k"},
                                        "spec": {}})
    cms = "/api/v1/namespaces/default/configmaps"
    late = await _post(emulator, cms, owned("late", job["metadata"]["uid"]))
    assert late["http"] == 201  # accepted, as a real API server does
    await _post(emulator, cms, owned("kept", job["metadata"]["uid"], live["metadata"]["uid"]))
    await wait_for("the late dependent collected", lambda: [
        c["metadata"]["name"] for c in emulator.list_objects("configmaps")] == ["kept"], 10.0)


async def test_namespaces_endpoint_and_recorded_calls(emulator: ApiEmulator) -> None:
    await _post(emulator, NS_PODS, _pod("a"))
    nss = await _json(emulator.get("/api/v1/namespaces"))
    assert [n["metadata"]["name"] for n in nss["items"]] == ["default"]
    one = await _json(emulator.get("/api/v1/namespaces/default"))
    assert one["http"] == 200 and one["kind"] == "Namespace"
    rules = emulator.rbac_rules()
    assert ("create", "", "pods", "default") in rules
    assert ("list", "", "namespaces", "") in rules
    assert ("get", "", "namespaces", "") in rules


async def test_kmock_reactions_still_take_precedence_for_fault_injection(
        emulator: ApiEmulator) -> None:
    emulator["post /api/v1/namespaces/default/pods"] << 503
    async with emulator.post(NS_PODS, json=_pod("x")) as resp:
        assert resp.status == 503
    assert emulator.list_objects("pods") == []  # the reaction answered; nothing was stored
    async with emulator.get(NS_PODS) as resp:  # other requests still reach the store
        assert resp.status == 200


def _as_operator(api: ApiEmulator) -> None:
    """Fault injection targets the operator's client; let this test's requests count as it."""
    api.faults.user_agent_prefix = "kmock/"


async def test_injected_write_faults_before_and_after_the_write(emulator: ApiEmulator) -> None:
    _as_operator(emulator)
    emulator.faults.fail_next("POST", f"{NS_PODS}/lost-reply", kind="after-500")
    emulator.faults.fail_next("POST", f"{NS_PODS}/refused", kind="before-500")
    assert (await _post(emulator, NS_PODS, _pod("lost-reply")))["http"] == 500
    assert (await _post(emulator, NS_PODS, _pod("refused")))["http"] == 500
    assert [p["metadata"]["name"] for p in emulator.list_objects("pods")] == ["lost-reply"]
    assert emulator.created("pods") == {("default", "lost-reply"): 1}  # it did take effect
    assert (await _post(emulator, NS_PODS, _pod("refused")))["http"] == 201  # once only
    emulator.faults = type(emulator.faults)(seed=3, write_error_fraction=0.5,
                                            user_agent_prefix="kmock/")
    answers = [(await _post(emulator, NS_PODS, _pod(f"r{i}")))["http"] for i in range(40)]
    assert 8 < sum(a != 201 for a in answers) < 32 and set(answers) <= {201, 409, 500}
    async with emulator.get(NS_PODS) as resp:  # reads are never faulted
        assert resp.status == 200


async def test_watch_streams_are_dropped_periodically(emulator: ApiEmulator) -> None:
    emulator.faults.watch_drop_seconds = 0.3
    started = asyncio.get_running_loop().time()
    events = await asyncio.wait_for(_watch(emulator, NS_PODS, {"resourceVersion": "1"}, 99), 5)
    assert events == [] and asyncio.get_running_loop().time() - started < 3


async def test_delayed_gc_orphan_and_delete_preconditions(emulator: ApiEmulator) -> None:
    emulator.faults.gc_delay_seconds = 0.5
    owners = []
    for name in ("lag", "orph"):
        job = await _post(emulator, JOBS, {"apiVersion": "cephalo.dev/v1alpha1",
                                           "kind": "CephaloJob", "metadata": {"name": name},
                                           "spec": {}})
        pod = _pod(f"{name}-child")
        pod["status"] = {}  # never ran: deleted at once, not gracefully
        pod["metadata"]["ownerReferences"] = [{
            "apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob", "name": name,
            "uid": job["metadata"]["uid"], "controller": True}]
        owners.append(await _post(emulator, NS_PODS, pod))
    await _json(emulator.delete(f"{JOBS}/lag"))
    await _json(emulator.delete(f"{JOBS}/orph", json={"propagationPolicy": "Orphan"}))
    names = {p["metadata"]["name"]: p for p in emulator.list_objects("pods")}
    assert set(names) == {"lag-child", "orph-child"}  # the GC has not run yet
    assert "ownerReferences" not in names["orph-child"]["metadata"]  # orphaned at once
    await asyncio.sleep(0.8)
    assert [p["metadata"]["name"] for p in emulator.list_objects("pods")] == ["orph-child"]
    wrong = await _json(emulator.delete(f"{NS_PODS}/orph-child", json={
        "preconditions": {"uid": owners[0]["metadata"]["uid"]}}))
    assert wrong["http"] == 409 and len(emulator.list_objects("pods")) == 1


async def test_running_pods_terminate_gracefully_with_sigterm(emulator: ApiEmulator) -> None:
    pod = _pod("run")
    pod["spec"]["terminationGracePeriodSeconds"] = 300
    await _post(emulator, NS_PODS, pod)
    await _patch(emulator, f"{NS_PODS}/run/status", {"status": {"phase": "Running",
                 "containerStatuses": [{"name": "c", "state": {"running": {}}}]}})
    deleting = await _json(emulator.delete(f"{NS_PODS}/run"))
    assert deleting["metadata"]["deletionTimestamp"]
    assert deleting["metadata"]["deletionGracePeriodSeconds"] == 300
    seen = await asyncio.wait_for(_watch(emulator, NS_PODS, {
        "resourceVersion": deleting["metadata"]["resourceVersion"]}, 2), 5)
    assert [e["type"] for e in seen] == ["MODIFIED", "DELETED"]
    terminated = seen[0]["object"]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert seen[0]["object"]["status"]["phase"] == "Failed" and terminated["exitCode"] == 143
    assert emulator.list_objects("pods") == []
