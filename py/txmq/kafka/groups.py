"""Consumer groups: Kafka's classic group protocol (JoinGroup, SyncGroup,
Heartbeat, LeaveGroup; the clients assign partitions themselves) and the
group's committed offsets (OffsetCommit, OffsetFetch).

Membership lives in memory on the event loop, as in a Kafka group
coordinator: a restart of the server makes every member rejoin. The
committed offsets are durable: a group's committed offset on a topic
partition is the mark-delete position of the txmq subscription named after
the group on that topic (created as a failover subscription the first
time the group commits there), so ``txmq subscriptions``, Spark and the
Python API see the same position. A topic partition the group has no
subscription for answers offset -1 (nothing committed).

States (Kafka's): EMPTY -> PREPARING_REBALANCE (a member joined, left or
timed out) -> COMPLETING_REBALANCE (every member rejoined, or the rebalance
timeout passed: a new generation, the leader got the member list) ->
STABLE (the leader sent the assignment) -> PREPARING_REBALANCE ...
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from txmq.errors import (InvalidArgumentError, SubscriptionNotFoundError, TopicNotFoundError,
                         PartitionNotFoundError, InvalidTopicNameError, InvalidSubscriptionNameError)
from txmq.kafka.protocol import Error

log = logging.getLogger("txmq.kafka")

EMPTY, PREPARING, COMPLETING, STABLE = "Empty", "PreparingRebalance", "CompletingRebalance", "Stable"
SESSION_TIMEOUT_MIN_MS = 1000
SESSION_TIMEOUT_MAX_MS = 30 * 60 * 1000
EXPIRY_CHECK_S = 0.25
# A new group waits this long for more members before its first generation
# (Kafka's group.initial.rebalance.delay.ms, shortened: one node, no cluster).
INITIAL_REBALANCE_DELAY_S = 0.3
SUBSCRIPTION_TYPE = "failover"


class Member:
    __slots__ = ("member_id", "instance_id", "client_id", "session_timeout", "rebalance_timeout",
                 "protocol_type", "protocols", "join", "sync", "assignment", "seen")

    def __init__(self, member_id: str, client_id: str | None):
        self.member_id = member_id
        self.instance_id = None
        self.client_id = client_id
        self.session_timeout = 10.0
        self.rebalance_timeout = 60.0
        self.protocol_type = ""
        self.protocols: list = []          # [(name, metadata)]
        self.join: asyncio.Future | None = None
        self.sync: asyncio.Future | None = None
        self.assignment = b""
        self.seen = time.monotonic()


class Group:
    def __init__(self, group_id: str):
        self.group_id = group_id
        self.state = EMPTY
        self.generation = 0
        self.protocol_type = None
        self.protocol = None
        self.leader = None
        self.members: dict = {}            # member id -> Member
        self.pending: set = set()          # ids handed out with MEMBER_ID_REQUIRED
        self.rebalance_task: asyncio.Task | None = None


class Groups:
    """Every consumer group of one server (event-loop thread only)."""

    def __init__(self, server):
        self.server = server
        self.broker = server.broker
        self.groups: dict = {}
        self._expiry: asyncio.Task | None = None

    def start(self) -> None:
        self._expiry = asyncio.get_event_loop().create_task(self._expire_loop())

    def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        for g in self.groups.values():
            if g.rebalance_task is not None:
                g.rebalance_task.cancel()

    def _group(self, group_id: str) -> Group:
        g = self.groups.get(group_id)
        if g is None:
            g = self.groups[group_id] = Group(group_id)
        return g

    # -- membership -------------------------------------------------------------------------

    async def join(self, conn, version: int, body: dict) -> dict:
        gid = body["group_id"]
        answer = {"throttle_time_ms": 0, "error_code": Error.NONE, "generation_id": -1,
                  "protocol_type": None, "protocol_name": "" if version < 7 else None, "leader": "",
                  "member_id": body["member_id"], "members": []}
        if not gid:
            return dict(answer, error_code=Error.INVALID_GROUP_ID)
        session_ms = body["session_timeout_ms"]
        if not SESSION_TIMEOUT_MIN_MS <= session_ms <= SESSION_TIMEOUT_MAX_MS:
            return dict(answer, error_code=Error.INVALID_SESSION_TIMEOUT)
        g = self._group(gid)
        protocols = [(p["name"], p["metadata"]) for p in body["protocols"]]
        if g.members and (body["protocol_type"] != g.protocol_type or
                          not self._common_protocol(g, protocols, body["member_id"])):
            return dict(answer, error_code=Error.INCONSISTENT_GROUP_PROTOCOL)
        member_id = body["member_id"]
        if not member_id:
            member_id = f"{conn.client_id or 'member'}-{uuid.uuid4()}"
            if version >= 4:
                g.pending.add(member_id)
                return dict(answer, error_code=Error.MEMBER_ID_REQUIRED, member_id=member_id)
        elif member_id not in g.members and member_id not in g.pending:
            return dict(answer, error_code=Error.UNKNOWN_MEMBER_ID)
        g.pending.discard(member_id)
        m = g.members.get(member_id)
        if m is None:
            m = g.members[member_id] = Member(member_id, conn.client_id)
        m.instance_id = body.get("group_instance_id")
        m.session_timeout = session_ms / 1000.0
        m.rebalance_timeout = body.get("rebalance_timeout_ms", session_ms) / 1000.0
        m.protocol_type = body["protocol_type"]
        m.protocols = protocols
        m.seen = time.monotonic()
        g.protocol_type = body["protocol_type"]
        if m.join is not None and not m.join.done():
            m.join.cancel()
        m.join = asyncio.get_event_loop().create_future()
        self._prepare_rebalance(g)
        self._maybe_complete(g)
        try:
            result = await asyncio.wait_for(asyncio.shield(m.join), m.rebalance_timeout + 5.0)
        except asyncio.TimeoutError:
            return dict(answer, error_code=Error.REBALANCE_IN_PROGRESS, member_id=member_id)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise
            return dict(answer, error_code=Error.REBALANCE_IN_PROGRESS, member_id=member_id)
        return dict(answer, **result)

    def _common_protocol(self, g: Group, protocols: list, member_id: str) -> bool:
        names = {n for n, _ in protocols}
        return all(names & {n for n, _ in m.protocols} for mid, m in g.members.items() if mid != member_id)

    def _prepare_rebalance(self, g: Group) -> None:
        if g.state == PREPARING:
            return
        for m in g.members.values():          # members waiting for an assignment must rejoin
            if m.sync is not None and not m.sync.done():
                m.sync.set_result({"error_code": Error.REBALANCE_IN_PROGRESS})
        delay = INITIAL_REBALANCE_DELAY_S if g.state == EMPTY else 0.0
        g.state = PREPARING
        timeout = max((m.rebalance_timeout for m in g.members.values()), default=1.0)
        g.rebalance_task = asyncio.get_event_loop().create_task(self._rebalance_deadline(g, timeout, delay))

    async def _rebalance_deadline(self, g: Group, timeout: float, delay: float) -> None:
        try:
            if delay:
                await asyncio.sleep(delay)
                self._maybe_complete(g, delayed=True)
                if g.state != PREPARING:
                    return
            await asyncio.sleep(max(0.0, timeout - delay))
            if g.state == PREPARING:
                self._complete(g)
        except asyncio.CancelledError:
            pass

    def _maybe_complete(self, g: Group, delayed: bool = False) -> None:
        if g.state != PREPARING:
            return
        if g.rebalance_task is not None and not delayed and _in_initial_delay(g):
            return
        if all(m.join is not None and not m.join.done() for m in g.members.values()):
            self._complete(g)

    def _complete(self, g: Group) -> None:
        """End the join phase: members that did not rejoin leave, a new
        generation starts, every waiting JoinGroup is answered."""
        task = g.rebalance_task
        g.rebalance_task = None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        for mid in [mid for mid, m in g.members.items() if m.join is None or m.join.done()]:
            del g.members[mid]
        g.generation += 1
        if not g.members:
            g.state, g.leader, g.protocol = EMPTY, None, None
            return
        g.protocol = self._choose_protocol(g)
        if g.leader not in g.members:
            g.leader = next(iter(g.members))
        g.state = COMPLETING
        members = [{"member_id": m.member_id, "group_instance_id": m.instance_id,
                    "metadata": dict(m.protocols).get(g.protocol, b"")} for m in g.members.values()]
        for m in g.members.values():
            m.assignment = b""
            m.join.set_result({"generation_id": g.generation, "protocol_type": g.protocol_type,
                               "protocol_name": g.protocol, "leader": g.leader, "member_id": m.member_id,
                               "members": members if m.member_id == g.leader else []})
        log.info("txmq.kafka: group %s: generation %d, %d member(s)", g.group_id, g.generation, len(g.members))

    def _choose_protocol(self, g: Group) -> str:
        """The protocol every member supports that most members list first
        (Kafka's vote), ties to the leader's preference."""
        common = None
        for m in g.members.values():
            names = {n for n, _ in m.protocols}
            common = names if common is None else common & names
        votes: dict = {}
        for m in g.members.values():
            for n, _ in m.protocols:
                if n in common:
                    votes[n] = votes.get(n, 0) + 1
                    break
        first = next(iter(g.members.values()))
        order = [n for n, _ in first.protocols if n in common]
        return max(order, key=lambda n: (votes.get(n, 0), -order.index(n)))

    async def sync(self, conn, version: int, body: dict) -> dict:
        g = self.groups.get(body["group_id"])
        answer = {"throttle_time_ms": 0, "error_code": Error.NONE, "protocol_type": None,
                  "protocol_name": None, "assignment": b""}
        m = g.members.get(body["member_id"]) if g is not None else None
        if m is None:
            return dict(answer, error_code=Error.UNKNOWN_MEMBER_ID)
        if body["generation_id"] != g.generation:
            return dict(answer, error_code=Error.ILLEGAL_GENERATION)
        if g.state == PREPARING:
            return dict(answer, error_code=Error.REBALANCE_IN_PROGRESS)
        m.seen = time.monotonic()
        answer.update(protocol_type=g.protocol_type, protocol_name=g.protocol)
        if g.state == STABLE:
            return dict(answer, assignment=m.assignment)
        m.sync = asyncio.get_event_loop().create_future()
        if m.member_id == g.leader:
            given = {a["member_id"]: a["assignment"] for a in body["assignments"]}
            for other in g.members.values():
                other.assignment = given.get(other.member_id, b"")
            g.state = STABLE
            for other in g.members.values():
                if other.sync is not None and not other.sync.done():
                    other.sync.set_result({"assignment": other.assignment})
        try:
            result = await asyncio.wait_for(asyncio.shield(m.sync), m.session_timeout + m.rebalance_timeout)
        except asyncio.TimeoutError:
            return dict(answer, error_code=Error.REBALANCE_IN_PROGRESS)
        return dict(answer, **result)

    async def heartbeat(self, conn, version: int, body: dict) -> dict:
        g = self.groups.get(body["group_id"])
        m = g.members.get(body["member_id"]) if g is not None else None
        code = Error.NONE
        if m is None:
            code = Error.UNKNOWN_MEMBER_ID
        elif body["generation_id"] != g.generation:
            code = Error.ILLEGAL_GENERATION
        else:
            m.seen = time.monotonic()
            if g.state == PREPARING:
                code = Error.REBALANCE_IN_PROGRESS
        return {"throttle_time_ms": 0, "error_code": code}

    async def leave(self, conn, version: int, body: dict) -> dict:
        g = self.groups.get(body["group_id"])
        if version < 3:
            leaving = [{"member_id": body["member_id"], "group_instance_id": None}]
        else:
            leaving = body["members"]
        results, code = [], Error.NONE
        for who in leaving:
            mid = who["member_id"]
            found = g is not None and mid in g.members
            if found:
                self._remove(g, mid, "left")
            elif version < 3:
                code = Error.UNKNOWN_MEMBER_ID
            results.append({"member_id": mid, "group_instance_id": who.get("group_instance_id"),
                            "error_code": Error.NONE if found else Error.UNKNOWN_MEMBER_ID})
        return {"throttle_time_ms": 0, "error_code": code, "members": results}

    def _remove(self, g: Group, member_id: str, why: str) -> None:
        m = g.members.pop(member_id)
        for fut in (m.join, m.sync):
            if fut is not None and not fut.done():
                fut.set_result({"error_code": Error.UNKNOWN_MEMBER_ID})
        log.info("txmq.kafka: group %s: member %s %s", g.group_id, member_id, why)
        if g.leader == member_id:
            g.leader = None
        if g.members:
            self._prepare_rebalance(g)
            self._maybe_complete(g)
        else:
            if g.rebalance_task is not None:
                g.rebalance_task.cancel()
                g.rebalance_task = None
            g.state, g.leader, g.protocol = EMPTY, None, None
            g.generation += 1

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_CHECK_S)
            now = time.monotonic()
            for g in list(self.groups.values()):
                for mid, m in list(g.members.items()):
                    waiting = m.join is not None and not m.join.done()
                    if not waiting and now - m.seen > m.session_timeout:
                        self._remove(g, mid, "timed out")

    def connection_closed(self, conn) -> None:
        """Nothing to do: members are kept until their session times out or
        they leave, as in Kafka (a client may reconnect)."""

    # -- committed offsets ----------------------------------------------------------------------

    def check_member(self, group_id: str, generation: int, member_id: str) -> int:
        """The error for an offset commit of (generation, member): none for
        a commit from outside the group protocol (generation -1)."""
        g = self.groups.get(group_id)
        if generation < 0:
            return Error.NONE
        if g is None or member_id not in g.members:
            return Error.UNKNOWN_MEMBER_ID
        if generation != g.generation:
            return Error.ILLEGAL_GENERATION
        if g.state == PREPARING:
            return Error.REBALANCE_IN_PROGRESS
        return Error.NONE

    async def offset_commit(self, conn, version: int, body: dict) -> dict:
        gid = body["group_id"]
        code = self.check_member(gid, body.get("generation_id_or_member_epoch", -1), body.get("member_id", ""))
        if code == Error.NONE:
            g = self.groups.get(gid)
            if g is not None and body.get("member_id") in g.members:
                g.members[body["member_id"]].seen = time.monotonic()
            topics = await self.server.blocking(self._commit_all, conn, gid, body["topics"])
        else:
            topics = [{"name": t["name"], "partitions": [{"partition_index": p["partition_index"],
                                                          "error_code": code} for p in t["partitions"]]}
                      for t in body["topics"]]
        return {"throttle_time_ms": 0, "topics": topics}

    def _commit_all(self, conn, group_id: str, topics: list) -> list:
        out = []
        for t in topics:
            name = t["name"]
            code = self.server.handlers.topic_ready(name, conn, op="read", create=False)
            if code == Error.NONE:
                code = self.server.handlers.group_allowed(conn, group_id)
            parts = []
            for p in t["partitions"]:
                err = code
                if err == Error.NONE:
                    try:
                        sub = self.subscription(name, group_id)
                        sub.seek(_lane(sub, p["partition_index"]), p["committed_offset"])
                    except (TopicNotFoundError, PartitionNotFoundError):
                        err = Error.UNKNOWN_TOPIC_OR_PARTITION
                    except (InvalidArgumentError, InvalidSubscriptionNameError, InvalidTopicNameError):
                        err = Error.INVALID_GROUP_ID
                parts.append({"partition_index": p["partition_index"], "error_code": err})
            out.append({"name": name, "partitions": parts})
        return out

    def subscription(self, topic: str, group_id: str):
        """The txmq subscription holding ``group_id``'s offsets on
        ``topic``, created (failover, from the earliest offset) if missing."""
        try:
            return self.broker._subscription(topic, group_id)
        except SubscriptionNotFoundError:
            self.broker.subscribe(topic, group_id, SUBSCRIPTION_TYPE, initial_position="earliest").close()
            return self.broker._subscription(topic, group_id)

    async def offset_fetch(self, conn, version: int, body: dict) -> dict:
        gid = body["group_id"]
        topics = await self.server.blocking(self._fetch_all, conn, gid, body["topics"],
                                            body.get("require_stable", False))
        return {"throttle_time_ms": 0, "topics": topics, "error_code": Error.NONE}

    def _fetch_all(self, conn, group_id: str, topics, require_stable: bool) -> list:
        may = self.server.handlers.may
        if topics is None:                     # every topic the group has offsets on (that the user sees)
            topics = []
            for name in self.broker.topics():
                if group_id in self.broker.subscriptions(name) and may(conn, name, "describe"):
                    n = len(self.broker._topic(name).partitions)
                    topics.append({"name": name, "partition_indexes": list(range(n))})
        out = []
        for t in topics:
            name = t["name"]
            parts = []
            try:
                sub = self.broker._subscription(name, group_id)
            except (SubscriptionNotFoundError, TopicNotFoundError, InvalidTopicNameError):
                sub = None
            pending = sub.pending_acks.pending_txns() if (sub is not None and require_stable) else ()
            denied = not may(conn, name, "describe")
            for index in t["partition_indexes"]:
                answer = {"partition_index": index, "committed_offset": -1, "committed_leader_epoch": -1,
                          "metadata": "", "error_code": Error.NONE}
                if denied:
                    answer["error_code"] = Error.TOPIC_AUTHORIZATION_FAILED
                elif sub is not None:
                    if 0 <= index < len(sub.lanes):
                        if pending:
                            answer["error_code"] = Error.UNSTABLE_OFFSET_COMMIT
                        else:
                            answer["committed_offset"] = sub.mark_delete(index)
                    else:
                        answer["error_code"] = Error.UNKNOWN_TOPIC_OR_PARTITION
                parts.append(answer)
            out.append({"name": name, "partitions": parts})
        return out


def _lane(sub, index: int) -> int:
    if not 0 <= index < len(sub.lanes):
        raise PartitionNotFoundError(sub.topic.name, index)
    return index


def _in_initial_delay(g: Group) -> bool:
    """True while a group's first rebalance still waits for more members."""
    return g.generation == 0
