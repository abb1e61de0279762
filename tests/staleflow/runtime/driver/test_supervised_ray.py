"""The supervisor's Ray faces (``staleflow.runtime.driver.supervised_ray``) reach the
actors they stand for, and turn Ray's errors into what the supervisor tells apart (a dead
actor, a call not answered in time). The actors are plain objects behind Ray's calling
convention (``FakeRay``); the real restarts are tested through launches."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from staleflow.runfolder.layout import RunLayout
from staleflow.runtime.driver.pools.parameter_server import PSPool
from staleflow.runtime.driver.pools.rewards import RewardPool
from staleflow.runtime.driver.supervised import ActorGone
from staleflow.runtime.driver.supervised_ray import (
    RayParameterServers,
    RayPending,
    RayRewardWorkers,
    RunFolderLive,
)
from tests.staleflow.runtime.fakes import Actor, ActorDied, FakeRay


class NotYet(TimeoutError):
    """Stands in for ``ray.exceptions.GetTimeoutError``."""


class KillingRay(FakeRay):
    class exceptions(FakeRay.exceptions):
        GetTimeoutError = NotYet

    def __init__(self) -> None:
        self.killed: list[object] = []

    def kill(self, actor: object, no_restart: bool = True) -> None:
        self.killed.append(actor)


class Worker:
    def __init__(self, pid: int, dead: bool = False) -> None:
        self._pid, self.dead, self.scored = pid, dead, []

    def ping(self) -> bool:
        if self.dead:
            raise ActorDied("The actor died unexpectedly before finishing this task.")
        return True

    def alive(self) -> bool:
        return not self.dead

    def slow(self) -> None:
        raise NotYet("Get timed out: some object(s) not ready.")

    def process_tasks(self, tasks: list[int]) -> None:
        self.scored.append(tasks)

    def stop(self) -> None:
        pass

    def pid(self) -> int:
        if self.dead:
            raise ActorDied("The actor is dead")
        return self._pid


def test_a_pending_call_tells_a_dead_actor_and_a_late_answer_from_a_failed_call():
    ray, w = KillingRay(), Worker(7, dead=True)
    pending = RayPending(ray, Actor(w).ping.remote())
    assert pending.done()
    with pytest.raises(ActorGone, match="died unexpectedly"):
        pending.result()
    with pytest.raises(TimeoutError) as late:
        RayPending(ray, Actor(w).slow.remote()).result(timeout_s=1)
    assert not isinstance(late.value, NotYet)  # Ray's own error does not leak out
    with pytest.raises(TypeError):  # a call that failed in a live actor stays as it was
        RayPending(ray, Actor(w).process_tasks.remote(1, 2)).result()
    assert RayPending(ray, Actor(Worker(8)).ping.remote()).result() is True


def test_the_reward_face_pings_scores_and_removes_the_pool_s_workers():
    ray = KillingRay()
    a, b = Worker(1), Worker(2)
    pool = RewardPool(None, ("reward/0", "reward/1"), tag="t")  # type: ignore[arg-type]
    pool.workers.update({"reward/0.0@t": Actor(a), "reward/1.0@t": Actor(b)})
    pool.role_of.update({"reward/0.0@t": "reward/0", "reward/1.0@t": "reward/1"})
    face = RayRewardWorkers(SimpleNamespace(ray=ray), pool, None)  # type: ignore[arg-type]
    assert face.ping("reward/1.0@t").result() is True
    face.score("reward/1.0@t", (4, 5)).result()
    assert b.scored == [[4, 5]] and a.scored == []
    handle = pool.workers["reward/0.0@t"]
    face.remove("reward/0.0@t")
    assert ray.killed == [handle] and list(face.live()) == ["reward/1.0@t"]
    assert face.role_of("reward/0.0@t") == "reward/0"  # still named for the events


def test_the_ps_face_reaches_each_replica_by_role():
    ray = KillingRay()
    replicas = {"ps/0": Actor(Worker(1)), "ps/1": Actor(Worker(2, dead=True))}
    pool = PSPool(None, replicas, {}, {"ps/0": "n0", "ps/1": "n1"})  # type: ignore[arg-type]
    face = RayParameterServers(SimpleNamespace(ray=ray), pool)  # type: ignore[arg-type]
    assert face.alive("ps/0").result() is True and face.alive("ps/1").result() is False
    face.kill("ps/1")
    assert ray.killed == [replicas["ps/1"]] and face.handles() == replicas


def test_live_json_names_every_answering_actor_s_pid_and_goes_at_the_end(tmp_path):
    live = RunFolderLive(KillingRay(), tmp_path)
    live.write({"instance/0": Actor(Worker(11)), "reward/0": Actor(Worker(12, dead=True))})
    info = RunLayout(tmp_path).read_live()
    assert info["pids"] == {"instance/0": 11}  # a dying one is written next time
    assert info["run"] == tmp_path.name and info["driver_pid"] > 0
    live.remove()
    assert not RunLayout(tmp_path).live.exists()
