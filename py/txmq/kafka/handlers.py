"""Dispatch of decoded requests, and the cluster-level APIs: ApiVersions,
Metadata, FindCoordinator, CreateTopics, DeleteTopics, DescribeConfigs,
SaslHandshake / SaslAuthenticate, and the topic access checks every
handler makes (the ACLs of a users file, txmq.kafka.auth).

txmq is one node: node id 0 at the server's advertised address leads
every partition, is the only replica, the controller, and the coordinator
of every group and transactional id.
"""

from __future__ import annotations

import logging

from txmq.errors import (InvalidTopicNameError, TopicExistsError, TopicNotFoundError, InvalidArgumentError,
                         DataDirError, TopicBusyError)
from txmq.kafka import protocol
from txmq.kafka.auth import PLAIN, AuthenticationFailed, ScramExchange
from txmq.kafka.data import DataPath
from txmq.kafka.groups import Groups
from txmq.kafka.protocol import Error
from txmq.kafka.schema import API_KEYS
from txmq.kafka.txns import Transactions
from txmq.storage.topic import check_topic_name

log = logging.getLogger("txmq.kafka")

NODE_ID = 0
CLUSTER_ID = "txmq"
INTERNAL_PREFIX = "txmq."            # txmq's own topics (txmq.sinks, txmq.half-check-max)
RESOURCE_TOPIC, RESOURCE_BROKER = 2, 4
CONFIG_SOURCE_DEFAULT, CONFIG_SOURCE_TOPIC = 5, 1
TOPIC_CONFIGS_SETTABLE = ("retention.ms", "retention.bytes", "cleanup.policy", "compression.type")


class Handlers:
    """Every API the server answers, by key."""

    def __init__(self, server):
        self.server = server
        self.broker = server.broker
        self.data = DataPath(server)
        self.groups = Groups(server)
        self.txns = Transactions(server)
        k = API_KEYS
        self.table = {
            k["ApiVersions"]: self.api_versions, k["Metadata"]: self.metadata,
            k["Produce"]: self.data.produce, k["Fetch"]: self.data.fetch,
            k["ListOffsets"]: self.data.list_offsets, k["CreateTopics"]: self.create_topics,
            k["DeleteTopics"]: self.delete_topics, k["DescribeConfigs"]: self.describe_configs,
            k["FindCoordinator"]: self.find_coordinator, k["JoinGroup"]: self.groups.join,
            k["SyncGroup"]: self.groups.sync, k["Heartbeat"]: self.groups.heartbeat,
            k["LeaveGroup"]: self.groups.leave, k["OffsetCommit"]: self.groups.offset_commit,
            k["OffsetFetch"]: self.groups.offset_fetch, k["InitProducerId"]: self.txns.init_producer_id,
            k["AddPartitionsToTxn"]: self.txns.add_partitions, k["AddOffsetsToTxn"]: self.txns.add_offsets,
            k["TxnOffsetCommit"]: self.txns.txn_offset_commit, k["EndTxn"]: self.txns.end_txn,
            k["SaslHandshake"]: self.sasl_handshake, k["SaslAuthenticate"]: self.sasl_authenticate,
        }
        assert set(self.table) == set(protocol.SUPPORTED_KEYS), "every advertised API has a handler"

    def start(self) -> None:
        self.data.start()
        self.groups.start()

    def stop(self) -> None:
        self.groups.stop()
        self.data.stop()
        self.txns.close()

    async def handle(self, conn, req) -> dict | None:
        return await self.table[req.api_key](conn, req.api_version, req.body)

    def connection_closed(self, conn) -> None:
        self.groups.connection_closed(conn)

    # -- access: every request is allowed unless a users file says otherwise (auth.py) ------------

    def may(self, conn, name: str, op: str) -> bool:
        """May the connection's user do ``op`` (read / write / describe) on
        topic ``name``? Always, without a users file."""
        users = self.server.users
        return users is None or users.allowed(conn.user, name, op)

    def topic_ready(self, name: str, conn, *, op: str, create: bool = True) -> int:
        """NONE when ``name`` exists and the user may ``op`` it (creating it
        when allowed and asked: creation needs ``write``), else the error
        to answer. Runs in the thread pool."""
        try:
            check_topic_name(name)
        except InvalidTopicNameError:
            return Error.INVALID_TOPIC_EXCEPTION
        if not self.may(conn, name, op):
            return Error.TOPIC_AUTHORIZATION_FAILED
        if name in self.broker._topics:
            return Error.NONE
        if create and self.server.auto_create_topics and not name.startswith(INTERNAL_PREFIX) \
                and self.may(conn, name, "write"):
            try:
                self.broker.create_topic(name, self.server.default_partitions)
                log.info("txmq.kafka: created topic %s (%d partitions) on first use", name,
                         self.server.default_partitions)
            except TopicExistsError:
                pass
            return Error.NONE
        return Error.UNKNOWN_TOPIC_OR_PARTITION

    def group_allowed(self, conn, group_id: str) -> int:
        return Error.NONE

    def transactional_id_allowed(self, conn, transactional_id: str) -> int:
        return Error.NONE

    # -- SaslHandshake / SaslAuthenticate ------------------------------------------------------

    async def sasl_handshake(self, conn, version: int, body: dict) -> dict:
        users = self.server.users
        mechanisms = [] if users is None else users.mechanisms()
        if conn.user is not None or conn.sasl is not None:
            conn.close_after = "SaslHandshake twice"
            return {"error_code": Error.ILLEGAL_SASL_STATE, "mechanisms": mechanisms}
        if body["mechanism"] not in mechanisms:
            return {"error_code": Error.UNSUPPORTED_SASL_MECHANISM, "mechanisms": mechanisms}
        conn.sasl = body["mechanism"]
        return {"error_code": Error.NONE, "mechanisms": mechanisms}

    async def sasl_authenticate(self, conn, version: int, body: dict) -> dict:
        answer = {"error_code": Error.NONE, "error_message": None, "auth_bytes": b"", "session_lifetime_ms": 0}
        users = self.server.users
        if users is None or conn.sasl is None or conn.user is not None:
            conn.close_after = "SaslAuthenticate without a SaslHandshake"
            return dict(answer, error_code=Error.ILLEGAL_SASL_STATE, error_message="SaslHandshake first")
        try:
            if conn.sasl == PLAIN:
                conn.user = await self.server.blocking(users.plain, body["auth_bytes"])
            else:
                if not isinstance(conn.sasl, ScramExchange):
                    conn.sasl = users.scram()
                # Each step hashes (the server's key work is at load time): off the loop all the same.
                answer["auth_bytes"] = await self.server.blocking(conn.sasl.step, body["auth_bytes"])
                conn.user = conn.sasl.user
        except AuthenticationFailed as e:
            conn.close_after = f"SASL: {e}"
            return dict(answer, error_code=Error.SASL_AUTHENTICATION_FAILED, error_message=str(e))
        if conn.user is not None:
            log.info("txmq.kafka: %s: authenticated as %s", conn.where, conn.user.name)
        return answer

    # -- ApiVersions / Metadata / FindCoordinator ---------------------------------------------

    async def api_versions(self, conn, version: int, body: dict) -> dict:
        return protocol.api_versions_body()

    def _broker_entry(self) -> dict:
        return {"node_id": NODE_ID, "host": self.server.advertised_host, "port": self.server.port, "rack": None}

    async def metadata(self, conn, version: int, body: dict) -> dict:
        return await self.server.blocking(self._metadata, conn, version, body)

    def _metadata(self, conn, version: int, body: dict) -> dict:
        wanted = body["topics"]
        if wanted is None or (version == 0 and not wanted):
            # Every topic the user may see (Kafka leaves out the others).
            names = [n for n in self.broker.topics() if self.may(conn, n, "describe")]
        else:
            names = [t["name"] for t in wanted]
        auto = body.get("allow_auto_topic_creation", True) if version >= 4 else True
        topics = []
        for name in names:
            entry = {"error_code": Error.NONE, "name": name, "topic_id": bytes(16),
                     "is_internal": name.startswith(INTERNAL_PREFIX), "partitions": [],
                     "topic_authorized_operations": -2147483648}
            if name is None:
                entry.update(error_code=Error.UNKNOWN_TOPIC_OR_PARTITION, name="")
                topics.append(entry)
                continue
            code = self.topic_ready(name, conn, op="describe", create=auto and wanted is not None)
            entry["error_code"] = code
            if code == Error.NONE:
                try:
                    n = len(self.broker._topic(name).partitions)
                except TopicNotFoundError:
                    entry["error_code"] = Error.UNKNOWN_TOPIC_OR_PARTITION
                    n = 0
                entry["partitions"] = [{"error_code": Error.NONE, "partition_index": i, "leader_id": NODE_ID,
                                        "leader_epoch": 0, "replica_nodes": [NODE_ID], "isr_nodes": [NODE_ID],
                                        "offline_replicas": []} for i in range(n)]
            topics.append(entry)
        return {"throttle_time_ms": 0, "brokers": [self._broker_entry()], "cluster_id": CLUSTER_ID,
                "controller_id": NODE_ID, "topics": topics, "cluster_authorized_operations": -2147483648}

    async def find_coordinator(self, conn, version: int, body: dict) -> dict:
        me = self._broker_entry()
        if version < 4:
            return {"throttle_time_ms": 0, "error_code": Error.NONE, "error_message": None,
                    "node_id": NODE_ID, "host": me["host"], "port": me["port"]}
        return {"throttle_time_ms": 0, "coordinators": [
            {"key": key, "node_id": NODE_ID, "host": me["host"], "port": me["port"], "error_code": Error.NONE,
             "error_message": None} for key in body["coordinator_keys"]]}

    # -- CreateTopics / DeleteTopics / DescribeConfigs ------------------------------------

    async def create_topics(self, conn, version: int, body: dict) -> dict:
        return await self.server.blocking(self._create_topics, conn, body)

    def _create_topics(self, conn, body: dict) -> dict:
        out = []
        for t in body["topics"]:
            name, n = t["name"], t["num_partitions"]
            n = self.server.default_partitions if n == -1 else n
            answer = {"name": name, "topic_id": bytes(16), "error_code": Error.NONE, "error_message": None,
                      "num_partitions": n, "replication_factor": 1, "configs": []}
            settings, problem = _topic_settings(t["configs"])
            if not self.may(conn, name, "write"):
                answer.update(error_code=Error.TOPIC_AUTHORIZATION_FAILED, error_message=f"may not create {name}")
            elif problem:
                answer.update(error_code=Error.INVALID_CONFIG, error_message=problem)
            elif t["replication_factor"] not in (-1, 1):
                answer.update(error_code=Error.INVALID_REPLICATION_FACTOR,
                              error_message="one node: the replication factor is 1")
            elif t["assignments"]:
                answer.update(error_code=Error.INVALID_REQUEST, error_message="replica assignments: one node")
            elif not body.get("validate_only"):
                try:
                    self.broker.create_topic(name, n, **settings)
                except TopicExistsError:
                    answer.update(error_code=Error.TOPIC_ALREADY_EXISTS, error_message=f"{name} exists")
                except InvalidTopicNameError as e:
                    answer.update(error_code=Error.INVALID_TOPIC_EXCEPTION, error_message=str(e))
                except (InvalidArgumentError, DataDirError) as e:
                    answer.update(error_code=Error.INVALID_PARTITIONS if "partitions" in str(e)
                                  else Error.INVALID_REQUEST, error_message=str(e))
            out.append(answer)
        return {"throttle_time_ms": 0, "topics": out}

    async def delete_topics(self, conn, version: int, body: dict) -> dict:
        return await self.server.blocking(self._delete_topics, conn, version, body)

    def _delete_topics(self, conn, version: int, body: dict) -> dict:
        names = body["topic_names"] if version < 6 else [t["name"] for t in body["topics"]]
        out = []
        for name in names:
            answer = {"name": name, "topic_id": bytes(16), "error_code": Error.NONE, "error_message": None}
            try:
                if name is None or name.startswith(INTERNAL_PREFIX):
                    raise TopicNotFoundError(name)
                if not self.may(conn, name, "write"):
                    answer.update(error_code=Error.TOPIC_AUTHORIZATION_FAILED, error_message=f"may not delete {name}")
                    out.append(answer)
                    continue
                self.broker.delete_topic(name, force=True)
            except (TopicNotFoundError, InvalidTopicNameError):
                answer["error_code"] = Error.UNKNOWN_TOPIC_OR_PARTITION
            except TopicBusyError as e:
                answer.update(error_code=Error.INVALID_REQUEST, error_message=str(e))
            out.append(answer)
        return {"throttle_time_ms": 0, "responses": out}

    async def describe_configs(self, conn, version: int, body: dict) -> dict:
        return await self.server.blocking(self._describe_configs, conn, body)

    def _describe_configs(self, conn, body: dict) -> dict:
        out = []
        for r in body["resources"]:
            answer = {"error_code": Error.NONE, "error_message": None, "resource_type": r["resource_type"],
                      "resource_name": r["resource_name"], "configs": []}
            if r["resource_type"] == RESOURCE_TOPIC and not self.may(conn, r["resource_name"], "describe"):
                answer.update(error_code=Error.TOPIC_AUTHORIZATION_FAILED, error_message="not authorized")
                configs = {}
            elif r["resource_type"] == RESOURCE_TOPIC:
                try:
                    configs = self._topic_configs(r["resource_name"])
                except (TopicNotFoundError, InvalidTopicNameError):
                    answer.update(error_code=Error.UNKNOWN_TOPIC_OR_PARTITION, error_message="no such topic")
                    configs = {}
            elif r["resource_type"] == RESOURCE_BROKER:
                configs = self._broker_configs()
            else:
                answer.update(error_code=Error.INVALID_REQUEST, error_message="topic or broker resources only")
                configs = {}
            keys = r["configuration_keys"]
            answer["configs"] = [
                {"name": k, "value": v, "read_only": k not in TOPIC_CONFIGS_SETTABLE, "is_default": src != 1,
                 "config_source": src, "is_sensitive": False, "synonyms": [], "config_type": 0,
                 "documentation": None}
                for k, (v, src) in sorted(configs.items()) if keys is None or k in keys]
            out.append(answer)
        return {"throttle_time_ms": 0, "results": out}

    def _topic_configs(self, name: str) -> dict:
        t = self.broker._topic(name)
        opts = self.broker._partition_options
        r_ms, r_bytes = t.config.get("retention_ms"), t.config.get("retention_bytes")
        return {
            "retention.ms": _cfg(r_ms, self.broker.retention_ms),
            "retention.bytes": _cfg(r_bytes, self.broker.retention_bytes),
            "cleanup.policy": ("delete", CONFIG_SOURCE_DEFAULT),
            "compression.type": ("producer", CONFIG_SOURCE_DEFAULT),
            "max.message.bytes": (str(opts["max_message_bytes"]), CONFIG_SOURCE_DEFAULT),
            "segment.bytes": (str(opts["segment_bytes_max"]), CONFIG_SOURCE_DEFAULT),
            "message.timestamp.type": ("CreateTime", CONFIG_SOURCE_DEFAULT),
            "min.insync.replicas": ("1", CONFIG_SOURCE_DEFAULT),
            "unclean.leader.election.enable": ("false", CONFIG_SOURCE_DEFAULT),
        }

    def _broker_configs(self) -> dict:
        return {
            "auto.create.topics.enable": (str(self.server.auto_create_topics).lower(), CONFIG_SOURCE_DEFAULT),
            "num.partitions": (str(self.server.default_partitions), CONFIG_SOURCE_DEFAULT),
            "socket.request.max.bytes": (str(self.server.max_request_bytes), CONFIG_SOURCE_DEFAULT),
            "transaction.max.timeout.ms": (str(int(self.broker.transaction_timeout_max * 1000)),
                                           CONFIG_SOURCE_DEFAULT),
            "default.replication.factor": ("1", CONFIG_SOURCE_DEFAULT),
            "log.dirs": (self.broker.path, CONFIG_SOURCE_DEFAULT),
        }


def _cfg(value, default) -> tuple:
    if value is not None:
        return str(value), CONFIG_SOURCE_TOPIC
    return ("-1" if default is None else str(default)), CONFIG_SOURCE_DEFAULT


def _topic_settings(configs: list) -> tuple:
    """CreateTopics configs as create_topic arguments, or a problem."""
    out = {}
    for c in configs:
        name, value = c["name"], c["value"]
        try:
            if name == "retention.ms":
                out["retention_ms"] = None if int(value) < 0 else int(value)
            elif name == "retention.bytes":
                out["retention_bytes"] = None if int(value) < 0 else int(value)
            elif name == "cleanup.policy":
                if value != "delete":
                    return out, f"cleanup.policy={value}: txmq deletes by retention only"
            elif name == "compression.type":
                if value != "producer":
                    return out, f"compression.type={value}: txmq stores what producers send, uncompressed"
            else:
                return out, f"{name}: not a topic setting txmq has ({', '.join(TOPIC_CONFIGS_SETTABLE)})"
        except (TypeError, ValueError):
            return out, f"{name}={value!r}: not an integer"
    return out, None
