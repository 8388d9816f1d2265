"""The router deployment: the HTTP ingress (the FastAPI app and its endpoints) and the encoder.
It checks a request's body against the limits (the HTTP entry: the layers under it take the
question as checked), plans the question as the library does (`pipeline.answer.plan`: the
manifest kept per conversation under a byte bound and re-read when its object changes, the
episode or the two read together when unsure, the top-up from the turn index), renders the
request's live tail (a chat client's session, which no cache holds) with the model's chat
template, and asks the decoder (a `DeploymentHandle`) for the answer."""

import asyncio
import gc
import hmac
import logging
import os
import threading
import time

from fastapi import FastAPI, Request
from ray import serve
from ray.exceptions import RayActorError

from pipeline.answer.lookup import check_models, embed_question
from pipeline.answer.plan import QuestionPlan, QuestionPlanner, QuestionTools
from pipeline.answer.topup import REPAIR, TopUp
from pipeline.config.limits import CheckedQuestion, LimitError
from pipeline.kv import models, prompts
from pipeline.kv.prompts import LIVE_ROLES, ChatTurn
from pipeline.serve import openai_chat
from pipeline.serve.errors import ApiError, add_exception_handlers, classify, is_corrupt
from pipeline.serve.schemas import AnswerRequest, ChatMessage, ChatRequest, parse_body
from pipeline.serve.settings import ServeSettings
from pipeline.store.backends.uri import open_store
from pipeline.store.catalogue.manifest import ManifestRecord
from pipeline.store.objects.cache_ref import CacheRef
from pipeline.telemetry import RequestMetrics, name_route, router_metrics

log = logging.getLogger("epicache.serve")


def public_name(model: str) -> str:
    """A model as a client may see it: a local folder by its last component, never its path."""
    if os.path.isabs(model) or model.startswith(("~", ".")):
        return os.path.basename(os.path.normpath(model)) or "model"
    return model


def refs_of(rows: list[ManifestRecord]) -> tuple[CacheRef, ...]:
    """What the decoder reads for a question: its episode's cache, or two joined."""
    return tuple(r.ref for r in rows)


UNUSABLE_INDEX = ("this conversation's turn index is missing, corrupt or unreadable (the server "
                  f"log names the object and why): answered from the episode alone; {REPAIR}")


def public_topup(topup: TopUp, records: list[ManifestRecord]) -> dict:
    """A question's top-up as a client sees it: its turns, tokens, status and note, not its text
    (the turn ids name it; the answer stays small). The library's note on an index it could not
    use names the object, so the client gets a fixed one (the server log has the library's)."""
    fields = {k: v for k, v in topup.as_dict().items() if k not in ("text", "hidden_spans")}
    if topup.status == "unavailable" and records[0].turn_index is not None:
        fields["note"] = UNUSABLE_INDEX
    return fields


app = FastAPI(title="EpiCache decode endpoint", docs_url=None, redoc_url=None)
add_exception_handlers(app)
# every request counted and timed by route and status (`epicache_requests`, docs/serving.md)
METRIC_ROUTES = {"/healthz": "healthz", "/v1/conversations/{conversation_id}": "conversation",
                 "/v1/conversations/{conversation_id}/answer": "answer",
                 "/v1/chat/completions": "chat"}
app.add_middleware(RequestMetrics, routes=METRIC_ROUTES, status_of=lambda e: classify(e)[0])


@serve.deployment(name="EpiCacheRouter")
@serve.ingress(app)
class Router:
    """Checks the request, plans the question (`QuestionPlanner`: embedded, routed to an
    episode, topped up), and asks the decoder for the answer."""

    def __init__(self, decoder, settings: ServeSettings, model: str, encoder: str):

        self.decoder = decoder
        self.settings = settings
        self.limits = self.settings.limits
        self.routing = self.settings.routing_config
        self.model_name, self.encoder_name = model, encoder
        self.store = open_store(self.settings.store, self.settings.store_options, create=False)
        self.encoder = models.load_encoder(encoder, "cpu")
        self.encoder_fingerprint = models.encoder_fingerprint(encoder)  # of the files loaded
        self.encoder_lock = threading.Lock()  # a tokenizer is not safe across threads
        # the top-up's text and the live tail are counted in the model's tokens, the live tail
        # rendered by its chat template (the tokenizer alone: the model is the decoder's)
        self.tokenizer = models.load_tokenizer(model)
        self.tokenizer_lock = threading.Lock()
        self.planner = QuestionPlanner(self.store, self._tools, self.routing,
                                       self.settings.topup_config, self.settings.manifest_ttl_s,
                                       self.settings.manifest_cache_bytes)
        self.topup_counts = {"used": 0, "none": 0, "unavailable": 0}
        self.metrics = router_metrics()  # pipeline.telemetry: exported through Ray
        # conversations whose stored data was found damaged (a manifest that does not read, a
        # cache object missing or failing its check) and not answered since: /healthz counts them
        self._corrupt: set[str] = set()
        self._background: set[asyncio.Task] = set()
        gc.freeze()  # the encoder's objects leave the collector: no 100+ ms pauses in an embed
        token = self.settings.auth_token
        self._token = token.encode() if token else None

    # -- helpers ------------------------------------------------------------------------------
    def _authorized(self, request: Request) -> bool:
        if self._token is None:
            return True
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                                   self._token)

    def _authorize(self, request: Request) -> None:
        if not self._authorized(request):
            raise ApiError(401, "missing or wrong bearer token (Authorization: Bearer <token>)")

    def _tools(self, records: list[ManifestRecord]) -> QuestionTools:
        """What plans a conversation's questions here: the one encoder and the served model's
        tokenizer, each under its lock (not safe across threads); a conversation built with
        another model or encoder (or other files of the encoder) is refused when its manifest
        is read (the decoder checks the model's files)."""
        check_models(records, self.model_name, self.encoder_name,
                     encoder_fingerprint=self.encoder_fingerprint)
        return QuestionTools(self._embed, self._count_tokens)

    def _embed(self, question: str):
        with self.encoder_lock:
            return embed_question(self.encoder, question)

    def _count_tokens(self, text: str) -> int:
        with self.tokenizer_lock:
            return prompts.count_tokens(self.tokenizer, text)

    def _checked(self, question: str, max_new_tokens: int | None, temperature: float | None,
                 names: tuple[str, str]) -> CheckedQuestion:
        """The question (its characters: the decoder counts its tokens), max_new_tokens and
        temperature, held to the limits `jobs.answer` holds them to (422 naming the field); a
        field not given takes its default."""
        max_new_tokens = (self.settings.default_max_new_tokens if max_new_tokens is None
                          else max_new_tokens)
        try:
            return self.limits.checked(question, max_new_tokens,
                                       0.0 if temperature is None else temperature,
                                       tuple(f"field '{name}'" for name in names))
        except LimitError as e:
            raise ApiError(422, str(e)) from None

    def _live_turns(self, messages: list[tuple[str, str]], field: str) -> list[ChatTurn]:
        """A live tail's messages as (role, text) pairs, each role one the chat template reads
        (OpenAI's "developer" is a system message; a tool's output has no turn here: 422
        naming the message), its text within the limit's character bound before any tokenizer
        sees it (422 naming `field`)."""
        turns = []
        for i, (role, text) in enumerate(messages):
            role = "system" if role == "developer" else role
            if role not in LIVE_ROLES:
                raise ApiError(422, f"field '{field}.{i}.role': a live tail's messages are "
                                    f"{', '.join(LIVE_ROLES)} or developer, not {role!r}")
            turns.append(ChatTurn(role, text))
        try:
            self.limits.check_live_chars(prompts.live_chars(turns), f"field '{field}'")
        except LimitError as e:
            raise ApiError(422, str(e)) from None
        return turns

    def _live_text(self, turns: list[ChatTurn], field: str) -> tuple[str, int]:
        """Blocking: the live tail as the decoder reads it (`prompts.live_text`, the model's
        chat template) and its tokens, held to the limit (422 naming `field`)."""
        if not turns:
            return "", 0
        with self.tokenizer_lock:
            text = prompts.live_text(self.tokenizer, turns)
            tokens = len(prompts.live_ids(self.tokenizer, text))
        try:
            self.limits.check_live_tokens(tokens, f"field '{field}'")
        except LimitError as e:
            raise ApiError(422, str(e)) from None
        return text, tokens

    async def _plan(self, conversation_id: str, question: str) -> QuestionPlan:
        """The question's plan (blocking: run in a thread), counted; the first question over a
        manifest as read hands the conversation's other episodes to the decoder's prefetch (a
        follow-up often routes to another episode). An error is the answer's (`_fault`)."""
        try:
            plan = await asyncio.to_thread(self.planner.plan, conversation_id, question)
        except ApiError:
            raise
        except Exception as e:
            raise self._fault(e, conversation_id) from None
        self.metrics.routed(len(plan.read))
        if plan.first:
            read = {r.episode for r in plan.read}
            self._prefetch([r.ref for r in plan.records if r.episode not in read])
        if plan.topup.status in self.topup_counts:
            self.topup_counts[plan.topup.status] += 1
            self.metrics.topup(plan.topup.status)
        return plan

    @staticmethod
    def _timings(plan: QuestionPlan) -> dict[str, float]:
        """The plan's timings as the answer reports them: the manifest lookup and the top-up
        count as route."""
        t = plan.timings_ms
        return {"embed": t["embed"], "route": t["manifest"] + t["route"] + t["topup"]}

    def _decoder_for(self, conversation_id: str, **options):
        """The decoder handle for a conversation's calls: with affinity, its id rides on the
        request (`multiplexed_model_id`, which `pipeline.serve.affinity` routes by)."""
        if self.settings.affinity:
            options["multiplexed_model_id"] = conversation_id
        return self.decoder.options(**options) if options else self.decoder

    def _prefetch(self, refs: list[CacheRef]) -> None:
        """Ask the decoder to load `refs` in the background; no request waits on it, and a
        failure is logged, never raised."""
        if not refs:
            return

        async def send() -> None:
            try:
                await self._decoder_for(refs[0].conversation_id).prefetch.remote(refs)
            except Exception as e:  # noqa: BLE001 - a prefetch is best effort
                log.warning("prefetch of %d episode(s) failed: %s", len(refs), e)

        task = asyncio.get_running_loop().create_task(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _fault(self, e: BaseException, conversation_id: str) -> ApiError:
        """The error to answer for `e` (`classify`); a damaged conversation is counted."""
        if is_corrupt(e):
            self._mark(conversation_id, corrupt=True)
        return ApiError(*classify(e, conversation_id))

    def _mark(self, conversation_id: str, corrupt: bool) -> None:
        """Count a conversation as damaged (logged when first met), or as answered again."""
        if not corrupt:
            self._corrupt.discard(conversation_id)
        elif conversation_id not in self._corrupt:
            self._corrupt.add(conversation_id)
            log.warning("conversation %s: its stored data is damaged (%d such conversations); "
                        "the others are served", conversation_id, len(self._corrupt))

    def _raise_if_error(self, result: dict, conversation_id: str) -> None:
        """The decoder's error as the answer's, else the conversation answered."""
        if "error" in result:
            error = result["error"]
            if error.get("corrupt"):
                self._mark(conversation_id, corrupt=True)
            raise ApiError(error["status"], error["message"])
        self._mark(conversation_id, corrupt=False)

    async def _ask_decoder(self, plan: QuestionPlan, question: CheckedQuestion,
                           live: str = "") -> dict:
        """The decoder's whole answer (`live`: the live tail's text, read after the top-up),
        asked again once if the replica died meanwhile (an answer has no side effect; Serve
        sends the retry to a live or replacement replica); a second death (503) or no answer
        within `decoder_timeout_s` in all (504) is an error, never a hang."""
        deadline = time.monotonic() + self.settings.decoder_timeout_s
        rows = plan.read
        for attempt in (1, 2):
            response = self._decoder_for(rows[0].conversation_id).answer.remote(
                refs_of(rows), question.text, question.max_new_tokens, question.temperature,
                plan.topup.text, live, plan.topup.hidden_spans)
            try:
                result = await asyncio.wait_for(response, max(0.0, deadline - time.monotonic()))
                break
            except RayActorError as e:
                response.cancel()
                if attempt == 2:
                    raise ApiError(*classify(e)) from None
                log.warning("the decoder replica died while answering; asking again once")
            except Exception as e:
                response.cancel()
                raise ApiError(*classify(e)) from None
        self._raise_if_error(result, rows[0].conversation_id)
        return result

    @staticmethod
    def _question_message(messages: list[ChatMessage]) -> tuple[ChatMessage, list[ChatMessage]]:
        """A chat request's question (its last message, a user's) and the messages before it
        (the live tail); 422 naming the field when the last message is not a user's (nothing
        after the question is dropped unread)."""
        users = [i for i, m in enumerate(messages) if m.role == "user"]
        if not users:
            raise ApiError(422, "field 'messages': no message with role 'user' (the last one is "
                                "the question)")
        last = users[-1]
        if last != len(messages) - 1:
            raise ApiError(422, f"field 'messages.{last + 1}': the last message must be the "
                                f"question, a 'user' message; a {messages[last + 1].role!r} "
                                "message after it is not read")
        return messages[last], messages[:last]

    # -- endpoints ----------------------------------------------------------------------------
    @app.get("/healthz")
    async def healthz(self, request: Request) -> dict:
        """Needs no token; without the server's token it says only whether it is healthy."""
        response = self.decoder.stats.remote()
        try:
            stats = await asyncio.wait_for(response, min(30.0, self.settings.decoder_timeout_s))
        except Exception as e:  # no decoder replica answering: not healthy
            response.cancel()
            raise ApiError(*classify(e)) from None
        if not self._authorized(request):
            return {"status": "ok"}
        return {"status": "ok", "model": public_name(self.model_name),
                "encoder": public_name(self.encoder_name),
                "conversations_loaded": self.planner.loaded,
                # the kept manifests' LRU: entries, bytes (at most max_bytes), reads, evictions
                "manifests": self.planner.manifest_stats(),
                # damaged stored data met and not answered since (the log names them)
                "conversations_corrupt": len(self._corrupt),
                "corrupt_conversations": sorted(self._corrupt)[:20],
                "topup": {"enabled": self.settings.topup, **self.topup_counts,
                          "index_bytes_fetched": self.planner.topups.fetched_bytes},
                "decoder": stats | {"model": public_name(stats["model"])}}

    @app.get("/v1/conversations/{conversation_id}")
    async def conversation(self, conversation_id: str, request: Request) -> dict:
        self._authorize(request)
        try:
            conv = await asyncio.to_thread(self.planner.conversation, conversation_id)
        except Exception as e:
            raise self._fault(e, conversation_id) from None
        first = conv.records[0]
        return {
            "conversation_id": conversation_id, "model_id": public_name(first.model_id),
            "encoder_id": public_name(first.encoder_id), "config_hash": first.config_hash,
            "scorer": first.scorer, "tokens": first.tokens, "turns": first.cache_turns,
            "appends": first.appends, "clustered_at": first.clustered_at,
            "episodes_requested": first.episodes_requested,
            "episodes_built": first.episodes_built, "episode_note": first.episode_note,
            "episodes": [{
                "episode": r.episode, "medoid_text": r.medoid_text,
                "medoid_turn_ids": r.medoid_turn_ids, "n_windows": r.n_windows,
                "layer_budgets": r.layer_budgets,
                "mean_budget": (sum(r.layer_budgets) / max(1, len(r.layer_budgets))
                                if r.layer_budgets else None),
                "object_key": r.object_key, "object_bytes": r.object_bytes,
                "kv_bytes": r.kv_bytes, "built_at": r.built_at} for r in conv.records]}

    @app.post("/v1/conversations/{conversation_id}/answer")
    async def answer(self, conversation_id: str, request: Request) -> dict:
        self._authorize(request)
        body = await parse_body(request, AnswerRequest, self.settings.max_body_bytes)
        question = self._checked(body.question, body.max_new_tokens, body.temperature,
                                 ("max_new_tokens", "temperature"))
        turns = self._live_turns([(m.role, m.content) for m in body.live or ()], "live")
        live, live_tokens = await asyncio.to_thread(self._live_text, turns, "live")
        plan = await self._plan(conversation_id, question.text)
        result = await self._ask_decoder(plan, question, live)
        timings = self._timings(plan) | {"fetch": result["fetch_ms"], "decode": result["decode_ms"]}
        rows = plan.read
        return {"conversation_id": conversation_id, "answer": result["answer"],
                "episode": rows[0].episode, "episodes": [r.episode for r in rows],
                "similarity": round(plan.similarity, 6), "topup": public_topup(plan.topup, rows),
                "live_tokens": live_tokens,
                "cache_hit": result["cache_hit"], "replica": result["replica"],
                "tokens": result["tokens"],
                "finish_reason": result["finish_reason"],
                "decoder_queue_ms": result["queue_ms"],
                "timings_ms": {k: round(timings[k], 3)
                               for k in ("embed", "route", "fetch", "decode")}}

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        self._authorize(request)
        body = await parse_body(request, ChatRequest, self.settings.max_body_bytes)
        name_route(request.scope, "chat_stream" if body.stream else "chat")
        if body.n not in (None, 1):
            raise ApiError(422, "field 'n': only n=1 is supported")
        asked, earlier = self._question_message(body.messages)
        question = self._checked(
            openai_chat.message_text(asked),
            body.max_completion_tokens if body.max_completion_tokens is not None
            else body.max_tokens, body.temperature, ("max_tokens", "temperature"))
        turns = self._live_turns([(m.role, openai_chat.message_text(m)) for m in earlier],
                                 "messages")
        live, live_tokens = await asyncio.to_thread(self._live_text, turns, "messages")
        plan = await self._plan(body.conversation_id, question.text)
        rows, timings = plan.read, self._timings(plan)
        meta = {"conversation_id": body.conversation_id, "episode": rows[0].episode,
                "episodes": [r.episode for r in rows], "similarity": round(plan.similarity, 6),
                "topup": public_topup(plan.topup, rows), "live_tokens": live_tokens}
        base = openai_chat.completion_base(public_name(self.model_name))
        if not body.stream:
            result = await self._ask_decoder(plan, question, live)
            timings |= {"fetch": result["fetch_ms"], "decode": result["decode_ms"]}
            return openai_chat.completion(base, result, meta, timings)

        gen = self._decoder_for(body.conversation_id, stream=True).stream.remote(
            refs_of(rows), question.text, question.max_new_tokens, question.temperature,
            plan.topup.text, live, plan.topup.hidden_spans)
        try:  # the fetch: a bad cache (or a dead replica) is an HTTP error, not a stream
            first = await asyncio.wait_for(gen.__anext__(), self.settings.decoder_timeout_s)
        except Exception as e:
            gen.cancel()
            raise ApiError(*classify(e)) from None
        if "error" in first:
            gen.cancel()
        self._raise_if_error(first, body.conversation_id)
        timings["fetch"] = first["fetch_ms"]
        meta |= {"cache_hit": first["cache_hit"]}
        return openai_chat.stream_response(gen, base, meta, timings,
                                           self.settings.decoder_timeout_s, body.include_usage)
