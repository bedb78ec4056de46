"""An aggregated prefill+decode replica (``epd serve --aggregate``): one process, the language
model's weights loaded once, one step loop for both.

The decode engine owns the loop; the prefill engine has no thread of its own and is its chunk
source (``epd.mixed``): every step runs each running decode row and prefill chunks up to
``prefill.step_tokens`` (less the decode rows) in one forward (``TextModelRunner.mixed_step``).
A prompt whose last chunk ran samples its first token and joins the decode batch of this process
with its state as it is (``PrefillServicer``'s local handoff: nothing is serialized); only when
this replica's decode side is full does it hand off over gRPC to another decode endpoint.

To the rest of the deployment it is both roles: one gRPC server with the Prefill and the Decode
services, registered once as a prefill replica that also serves decode (``Endpoint.also_roles``),
so routers balance prompts over it and stream tokens from it, resume a request it lost elsewhere,
and other replicas may hand off to it. This is the one role module that imports two others: it
only composes them.
"""

from __future__ import annotations

from decode_svc.engine import DecodeEngine
from decode_svc.server import DecodeServicer, submit_handoff
from epd import discovery, memory_plan, rpc
from epd.config import ServeConfig
from epd.discovery import Load, Membership, RoleContext
from epd.grammar import tokenizer_for as grammar_tokenizer_for
from epd.lm import HybridState, TextModelRunner
from epd.metrics import serve_metrics
from epd.modelinfo import ModelInfo
from epd.store import EmbeddingStore
from epd.tensors import configure_threads, default_device, freeze_startup_heap, release_thread_team
from epd.v1 import epd_pb2, epd_pb2_grpc
from prefill_svc.engine import PrefillEngine
from prefill_svc.server import PrefillServicer


class AggregateServer(rpc.RoleServer):
    """Hosts the Prefill and Decode services over one engine in its own process (a Ray actor the
    controller makes in the prefill role's place)."""

    def __init__(self, serve: ServeConfig, context: RoleContext) -> None:
        rpc.configure(serve.rpc)
        config = serve.decode  # the language model's dtype, threads and cores (prefill's must agree)
        configure_threads(config.num_threads, config.cpus)
        # before a weight is read: the weights once, decode's pool and slots, a step's activations
        memory_plan.check_role(serve.model_dir, memory_plan.AGGREGATE, serve,
                               *memory_plan.device_available(default_device()))
        info = ModelInfo.load(serve.model_dir)
        # loaded as a decode replica loads it (merged projections: prefill forwards through them
        # cost the same, docs/BENCHMARKS.md), since every decode step of this replica runs here
        runner = TextModelRunner.load(serve.model_dir, dtype=config.dtype, prepack=config.prepack, decode=True)
        runner.prepare_decode_kernels()
        self.prefill = PrefillEngine(runner, info, EmbeddingStore.from_config(serve.store), serve.prefill,
                                     own_loop=False)
        self.decode = DecodeEngine(runner, info.eos_token_ids, config,
                                   grammar_tokenizer=lambda: grammar_tokenizer_for(info), chunk_source=self.prefill)
        internal = rpc.internal_transport(serve.security)
        self._decode_targets = discovery.decode_targets(context, internal, serve.replica_wait_s)
        self.prefill_servicer = PrefillServicer(self.prefill, self._decode_targets, local_handoff=self._local_handoff,
                                                host=context.host, shared_memory=serve.prefill.shared_memory_handoff)
        self._serve([(epd_pb2_grpc.add_PrefillServicer_to_server, self.prefill_servicer, "epd.v1.Prefill"),
                     (epd_pb2_grpc.add_DecodeServicer_to_server, DecodeServicer(self.decode), "epd.v1.Decode")],
                    context.host, internal)
        self._metrics = serve_metrics(lambda: [*self.prefill.metrics(), *self.prefill_servicer.metrics(),
                                               *self.decode.metrics()], self.host,
                                      serve.prefill.metrics_port or config.metrics_port)
        freeze_startup_heap()  # before it takes work: see epd/tensors.py
        self.membership = Membership(context, address=self.address(), capacity_tokens=self.decode.capacity_tokens(),
                                     load=self._load, also_roles=("decode",))
        self.prefill.on_stored = self.membership.report_soon
        release_thread_team()  # the decode loop's thread runs the forwards (epd/tensors.py)

    def _local_handoff(self, header: epd_pb2.HandoffHeader, state: HybridState, log_id: str) -> str:
        """The prompt decodes here: its place is held as a handoff's would be (RESOURCE_EXHAUSTED
        when the waiting queue is full), then its state joins the queue as it is."""
        self.decode.check_handoff(header.request_id, header.prompt_len, header.sampling.max_tokens,
                                  max(1, header.num_generated))
        try:
            submit_handoff(self.decode, header, state, log_id)
        except BaseException:
            self.decode.release(header.request_id)
            raise
        return self.address()

    def _load(self) -> Load:
        """Both sides' reports in one: queued prompt tokens and prefixes (prefill routing reads
        them), free K/V tokens and waiting handoffs (decode routing does)."""
        prefill, decode = self.prefill.load(), self.decode.load()
        return Load(queued_tokens=prefill.queued_tokens, prefix_summary=prefill.prefix_summary,
                    prefix_block_size=prefill.prefix_block_size, free_kv_tokens=decode.free_kv_tokens,
                    num_waiting=decode.num_waiting)

    def work(self) -> dict[str, float]:
        """Its prefill work since it started (``PrefillEngine.work``: busy seconds are mixed steps')."""
        return self.prefill.work()

    def kv_usage(self) -> dict[str, float]:
        """The K/V pool now (``epd status``)."""
        return self.decode.kv_usage()

    def in_flight(self) -> int:
        """Calls running plus requests decoding here: a drained replica holds none."""
        return super().in_flight() + self.decode.num_held()

    def requests(self) -> int:
        """Prompts waiting for or in their prefill, and requests decoding here."""
        return self.prefill.num_waiting() + self.decode.num_held()

    def stop(self, grace_s: float = 1.0) -> None:
        self.membership.close()
        self._decode_targets.close()
        super().stop(grace_s)
        self.decode.stop()
        self.prefill.stop()
        if self._metrics is not None:
            self._metrics.shutdown()
