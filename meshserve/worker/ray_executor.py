"""TP x PP ranks as Ray actors, so one command spans the nodes of a Ray cluster.

The ranks are placed by a placement group (one bundle per rank: a GPU each on CUDA, a CPU each on
CPU), packed onto as few nodes as possible. Rank 0 opens the torch.distributed store on its node and
reports its address through Ray, so no address has to be configured. Each step is put into the
object store once and handed to every actor; a dead actor surfaces as a WorkerFailure naming its
rank, after which every actor is killed and the placement group released.

The model path must be readable on every node (a shared file system, or the same path everywhere).
"""
from __future__ import annotations

import logging
import os
from collections import defaultdict
from datetime import timedelta
from typing import TYPE_CHECKING

from meshserve.config import EngineConfig
from meshserve.models.loader import ModelSource
from meshserve.worker.executor import DistributedExecutor, WorkerFailure
from meshserve.worker.rank_messages import RankCall, RankMethod
from meshserve.worker.step import StepInput

if TYPE_CHECKING:  # imported in the actor, where they run
    from torch.distributed import TCPStore

    from meshserve.worker.worker import Worker

logger = logging.getLogger("meshserve")

_PLACEMENT_TIMEOUT_S = 120.0
_STORE_TIMEOUT = timedelta(seconds=300)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'meshserve[ray]'") from None
    return ray


class RayWorkerActor:
    """One rank inside a Ray actor (wrapped with ray.remote by the executor)."""

    def __init__(self) -> None:
        self.worker: Worker | None = None  # made by start
        self.store: TCPStore | None = None  # rank 0's, from open_store

    def node_id(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def open_store(self, host: str, world: int) -> int:
        """Rank 0: listen for the other ranks on a free port of this node; returns the port."""
        from torch.distributed import TCPStore
        self.store = TCPStore(host, 0, world, is_master=True, timeout=_STORE_TIMEOUT, wait_for_workers=False)
        return self.store.port

    def start(self, config: EngineConfig, source: ModelSource, max_model_len: int, rank: int, node_ip: str,
              host: str, port: int, local_rank: int, local_world: int) -> dict:
        import torch
        from torch.distributed import TCPStore

        from meshserve.distributed.placement import available_cores, place
        from meshserve.worker.worker import Worker

        _gloo_on_interface_of(node_ip)
        store = self.store or TCPStore(host, port, config.world_size, is_master=False, timeout=_STORE_TIMEOUT)
        device = config.resolved_device()
        if device.type == "cuda":
            device = torch.device("cuda", 0)  # Ray shows each actor only the GPU it was given
        share = place(1, local_world, available_cores())[0].ranks[local_rank].cores  # ranks on this node
        self.worker = Worker(config, source, max_model_len, rank, store, device, list(share))
        return self.worker.info

    def call(self, method: RankMethod, *args):
        # The arguments travel at the top level of the Ray call, where Ray resolves an ObjectRef
        # (the step, stored once for every actor) to its value; inside a RankCall it would not.
        return RankCall(method, args).apply(self.worker)


def _gloo_on_interface_of(ip: str) -> None:
    """Gloo picks its interface from the host name, which on many hosts resolves to loopback or to an
    address the other nodes cannot reach; use the interface that carries Ray's node address."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    import psutil
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return


class RayExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int):
        super().__init__(config)
        ray = self._ray = _import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init()  # joins the cluster named by RAY_ADDRESS, else starts a local one
        world = config.world_size
        gpu = config.resolved_device().type == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        self.pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=_PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            raise ValueError(f"the Ray cluster cannot place {world} workers needing {bundle} each "
                             f"(it has {ray.cluster_resources()})") from None
        self._remove_pg = remove_placement_group
        actor_cls = ray.remote(RayWorkerActor)
        self.actors = [actor_cls.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
        ).remote() for r in range(world)]
        # Each node's address as the cluster knows it (what the other nodes can reach).
        address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        ips = [address[n] for n in self._get([a.node_id.remote() for a in self.actors])]
        port = self._get([self.actors[0].open_store.remote(ips[0], world)])[0]
        on_node = defaultdict(list)
        for rank, ip in enumerate(ips):
            on_node[ip].append(rank)
        self.infos = self._get([
            a.start.remote(config, source, max_model_len, rank, ips[rank], ips[0], port,
                           on_node[ips[rank]].index(rank), len(on_node[ips[rank]]))
            for rank, a in enumerate(self.actors)])
        logger.info("%d Ray workers (TP=%d x PP=%d) on %d node(s), rank 0 at %s:%d", world,
                    config.tensor_parallel_size, config.pipeline_parallel_size, len(on_node), ips[0], port)

    def _get(self, refs: list, timeout: float | None = None) -> list:
        """Results in rank order. On a failure the rank whose actor died is named before ranks whose
        task failed (typically inside a collective with the dead one)."""
        ray = self._ray
        rank_of = {ref: r for r, ref in enumerate(refs)}
        pending, results = list(refs), {}
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                raise TimeoutError(f"ranks {sorted(rank_of[r] for r in pending)} did not answer within {timeout} s")
            try:
                results[rank_of[ready[0]]] = ray.get(ready[0])
            except ray.exceptions.RayError as exc:
                failed = {rank_of[ready[0]]: exc}
                more, _ = ray.wait(pending, num_returns=len(pending), timeout=1.0) if pending else ([], [])
                for ref in more:
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayError as e:
                        failed[rank_of[ref]] = e
                dead = [r for r, e in failed.items() if isinstance(e, ray.exceptions.RayActorError)]
                rank = dead[0] if dead else next(iter(failed))
                self._fail(rank, failed[rank])
        return [results[r] for r in range(len(refs))]

    def _fail(self, rank: int, exc: Exception):
        message = f"worker rank {rank} (Ray actor) %s; stopped all {len(self.actors)} workers"
        if isinstance(exc, self._ray.exceptions.RayActorError):
            message = message % "died"
        else:
            message = message % "failed" + f". Its error:\n{exc}"
        self._failure = WorkerFailure(rank, message)
        self._release()
        raise self._failure

    def _release(self) -> None:
        self._closed = True
        for a in self.actors:
            self._ray.kill(a)
        self._remove_pg(self.pg)

    def _call_all(self, method: RankMethod, *args) -> list:
        if self._failure is not None:
            raise self._failure
        return self._get([a.call.remote(method, *args) for a in self.actors])

    def _step_arg(self, step: StepInput):
        return self._ray.put(step)  # stored once, read by every actor

    health_check_interval = 5.0  # Ray actors have no process sentinel here: poll

    def _probe(self) -> None:
        self._get([a.node_id.remote() for a in self.actors], timeout=30.0)

    def shutdown(self) -> None:
        if self._closed:
            return
        try:
            self._get([a.call.remote(RankMethod.CLOSE) for a in self.actors], timeout=10.0)
        except (WorkerFailure, TimeoutError) as exc:
            logger.warning("Ray workers did not stop cleanly: %s", exc)
        if not self._closed:
            self._release()
        super().shutdown()
