"""Synthetic long conversations with known topics and planted, answerable facts.

Real corpora (LoCoMo) are few and short; tests, benchmarks and scaling runs need conversations
of any length whose structure is known. Two speakers talk over many dated sessions; the talk
moves between `n_topics` topics in stretches of consecutive turns, and topics recur across
sessions, so the episode clustering has something real to find. Within a topic some turns
state a specific fact ("I named my new puppy Biscuit."), and every planted fact comes with a
single-hop question whose evidence is that turn, so retention and QA can be measured.

Everything is drawn from `random.Random` instances seeded from (seed, conversation id): the same
arguments always give the same conversation, and the global `random` module is never touched.
"""

from __future__ import annotations

import datetime as dt
import json
import random
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources

from pipeline.corpus.render import render_header, render_session_header, render_turn
from pipeline.corpus.schema import Conversation, Question, Turn, check_safe_id


def estimate_tokens(text: str) -> int:
    """Cheap token count: about 4 characters per token, the usual rule of thumb for English
    text under BPE tokenizers (Llama, GPT, SmolLM). Off by maybe 10-20% for a given tokenizer,
    which is good enough to size conversations without loading one."""
    return (len(text) + 3) // 4


# ---------------------------------------------------------------------------------------------
# Topics: openers, chatter templates with slots, slot vocabulary, and the kinds of facts.
# The text itself lives in data/synthetic.json (package data), read once at import.
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FactSpec:
    """A kind of fact a speaker can state. With `keys`, one independent fact per key (e.g. how
    long each peak took), which lets long conversations plant many distinct facts."""
    statement: str                   # first person; uses {value} and, if keyed, {key}
    question: str                    # uses {speaker} and, if keyed, {key}
    values: tuple[str, ...]
    keys: tuple[str, ...] = ("",)


@dataclass(frozen=True)
class Topic:
    """What one topic sounds like. Templates use {other} (the listener), {when} and the topic's
    own `words`; openers start a stretch, chatter fills it."""
    name: str
    openers: tuple[str, ...]
    chatter: tuple[str, ...]
    words: dict[str, tuple[str, ...]]
    facts: tuple[FactSpec, ...]


def _read_data() -> dict:
    """The vocabulary file, read through importlib.resources so it works from a wheel too."""
    text = (resources.files("pipeline.corpus").joinpath("data/synthetic.json")
            .read_text(encoding="utf-8"))
    return json.loads(text)


def _topic(raw: dict) -> Topic:
    """One topic of the data file, as tuples (templates are compared and concatenated as such).
    A fact's `values` or `keys` given as a string names one of the topic's word lists, so a
    vocabulary is written once; an unkeyed fact has no `keys`."""
    words = {slot: tuple(values) for slot, values in raw["words"].items()}

    def vocab(ref: str | list[str]) -> tuple[str, ...]:
        return words[ref] if isinstance(ref, str) else tuple(ref)

    facts = tuple(FactSpec(f["statement"], f["question"], vocab(f["values"]),
                           vocab(f.get("keys", [""])))
                  for f in raw["facts"])
    return Topic(raw["name"], tuple(raw["openers"]), tuple(raw["chatter"]), words, facts)


_DATA = _read_data()
_TOPIC_LIST: tuple[Topic, ...] = tuple(_topic(raw) for raw in _DATA["topics"])
_TOPICS_BY_NAME: dict[str, Topic] = {t.name: t for t in _TOPIC_LIST}
TOPICS: tuple[str, ...] = tuple(t.name for t in _TOPIC_LIST)

# Short, topic-free sentences that some turns start with, so turns do not all open the same way.
_INTERJECTIONS: tuple[str, ...] = tuple(_DATA["interjections"])
# ... and that some one-sentence turns end with, handing the word to the other speaker.
_CLOSERS: tuple[str, ...] = tuple(_DATA["closers"])
_WHEN: tuple[str, ...] = tuple(_DATA["when"])
_SPEAKER_NAMES: tuple[str, ...] = tuple(_DATA["speaker_names"])
# Spelled out, not from `calendar`, so that timestamps never depend on the locale.
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December")


# ---------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------

# Average rendered turn, measured on generated text; only used to size stretches so that short
# conversations still visit every topic.
_AVG_TURN_TOKENS = 33
_STRETCH_TURNS = (8, 20)   # consecutive turns on one topic
_FACT_EVERY = (300, 500)   # tokens between planted facts (after the first visit of each topic)


class _Slots(dict):
    """Fills a template's {slot} with a fresh random word of the topic on every lookup."""

    def __init__(self, rng: random.Random, words: dict[str, tuple[str, ...]], **fixed: str):
        super().__init__(fixed)
        self.rng, self.words = rng, words

    def __missing__(self, key: str) -> str:
        if key == "when":
            return self.rng.choice(_WHEN)
        return self.rng.choice(self.words[key])


def _timestamp(when: dt.datetime) -> str:
    """LoCoMo's date style: '2:15 pm on 3 March, 2024' (no locale involved)."""
    hour = when.hour % 12 or 12
    half = "am" if when.hour < 12 else "pm"
    return f"{hour}:{when.minute:02d} {half} on {when.day} {_MONTHS[when.month - 1]}, {when.year}"


class _Writer:
    """Appends turns to one conversation, keeping the rendered length and the fact schedule."""

    def __init__(self, rng: random.Random, speakers: tuple[str, str], topics: list[Topic],
                 target_tokens: int):
        self.rng, self.speakers, self.topics, self.target = rng, speakers, topics, target_tokens
        self.turns: list[Turn] = []
        self.questions: list[Question] = []
        # Rendered length so far, mirroring `render_turns` exactly (header, then lines joined by
        # "\n", a blank line and a date line before each session), so no re-rendering is needed.
        self.chars = len(render_header(Conversation("x", speakers, ())))
        self.session, self.n_in_session, self.timestamp = 0, 0, ""
        self.clock = dt.datetime(rng.randint(2021, 2024), rng.randint(1, 12), rng.randint(1, 28))
        self.speaker_index = 0
        # Facts not yet stated, per (topic, speaker): shuffled (spec, key) pairs, popped in order.
        self.unused_facts = {(t.name, s): self._fact_pool(t) for t in topics for s in speakers}
        self.tokens_since_fact = 0
        self.next_fact_at = rng.uniform(*_FACT_EVERY) / 2  # short conversations get one too
        self.recent: deque[str] = deque(maxlen=12)  # templates used lately, not reused soon
        self.turns_per_topic: Counter[str] = Counter()

    def _fact_pool(self, topic: Topic) -> list[tuple[FactSpec, str]]:
        pool = [(spec, key) for spec in topic.facts for key in spec.keys]
        self.rng.shuffle(pool)
        return pool

    def pick(self, templates: tuple[str, ...]) -> str:
        """A template not used in the last few turns (so nearby turns do not repeat)."""
        fresh = [t for t in templates if t not in self.recent]
        template = self.rng.choice(fresh or templates)
        self.recent.append(template)
        return template

    def tokens(self) -> int:
        return (self.chars + 3) // 4  # estimate_tokens of the rendered conversation

    def done(self) -> bool:
        return self.tokens() >= self.target

    def new_session(self) -> None:
        """Move the clock forward (1-21 days, a daytime hour) and start the next session."""
        day = self.clock.date() + dt.timedelta(days=self.rng.randint(1, 21))
        self.clock = dt.datetime(day.year, day.month, day.day, self.rng.randint(8, 21),
                                 self.rng.choice(range(0, 60, 5)))
        self.session += 1
        self.n_in_session = 0
        self.timestamp = _timestamp(self.clock)
        self.speaker_index = self.rng.randrange(2)  # either speaker may open a session
        header = render_session_header(Turn("", "", "", self.session, self.timestamp))
        self.chars += 2 + len(header)  # "\n" + "" (blank line) + "\n" + header

    def add_turn(self, topic: Topic, opener: bool, fact: bool) -> None:
        """One turn by the next speaker: an opener or chatter, possibly stating a fact."""
        speaker = self.speakers[self.speaker_index]
        other = self.speakers[1 - self.speaker_index]
        self.speaker_index = 1 - self.speaker_index
        slots = _Slots(self.rng, topic.words, other=other)
        short = self.target - self.tokens() < 40  # keep the last turns small near the target

        body = [self.pick(topic.openers if opener else topic.chatter).format_map(slots)]
        if not short and self.rng.random() < 0.6:
            body.append(self.pick(topic.chatter).format_map(slots))
        elif not (short or fact) and self.rng.random() < 0.3:
            body.append(self.rng.choice(_CLOSERS).format_map(slots))
        lead = self.rng.choice(_INTERJECTIONS) if not (opener or short) and \
            self.rng.random() < 0.25 else None
        self.n_in_session += 1
        turn_id = f"D{self.session}:{self.n_in_session}"

        stated = self._plant_fact(topic, speaker, turn_id) if fact else None
        if stated is not None:
            if opener:
                body.insert(1, stated)         # the opener, then the fact
            elif self.rng.random() < 0.5:
                body[0] = stated               # the fact, then maybe some chatter
            else:
                body = [body[-1], stated]      # some chatter, then the fact
        sentences = ([lead] if lead else []) + body

        turn = Turn(turn_id, speaker, " ".join(sentences), self.session, self.timestamp,
                    meta={"topic": topic.name})
        self.turns.append(turn)
        self.turns_per_topic[topic.name] += 1
        added = 1 + len(render_turn(turn))
        self.chars += added
        self.tokens_since_fact = 0 if stated is not None else self.tokens_since_fact + added // 4

    def _plant_fact(self, topic: Topic, speaker: str, turn_id: str) -> str | None:
        """The sentence stating a new fact (and its question), or None if none is left."""
        pool = self.unused_facts[(topic.name, speaker)]
        if not pool:
            return None
        spec, key = pool.pop()
        value = self.rng.choice(spec.values)
        self.questions.append(Question(
            question=spec.question.format(speaker=speaker, key=key),
            answer=value, evidence=(turn_id,), category=4, meta={"topic": topic.name}))
        self.next_fact_at = self.rng.uniform(*_FACT_EVERY)
        return spec.statement.format(value=value, key=key)

    def fact_due(self) -> bool:
        return self.tokens_since_fact >= self.next_fact_at


def make_conversation(conversation_id: str, target_tokens: int, seed: int, n_topics: int = 4,
                      speakers: tuple[str, str] | None = None) -> Conversation:
    """A two-speaker, multi-session conversation of about `target_tokens` estimated tokens
    (at least the target, at most about one turn above it) over `n_topics` seeded topics,
    with a single-hop question for every planted fact."""
    check_safe_id(conversation_id)
    if target_tokens < 1:
        raise ValueError(f"target_tokens must be positive, got {target_tokens}")
    if not 1 <= n_topics <= len(TOPICS):
        raise ValueError(f"n_topics must be between 1 and {len(TOPICS)}, got {n_topics}")
    rng = random.Random(f"synthetic/{seed}/{conversation_id}")
    if speakers is None:
        speakers = tuple(rng.sample(_SPEAKER_NAMES, 2))
    if len(speakers) != 2 or speakers[0] == speakers[1] or not all(s.strip() for s in speakers):
        raise ValueError(f"speakers must be two distinct non-empty names, got {speakers!r}")
    topics = [_TOPICS_BY_NAME[name] for name in rng.sample(TOPICS, n_topics)]
    writer = _Writer(rng, speakers, topics, target_tokens)

    # Stretches are capped so that even a short conversation visits every topic once.
    cap = max(3, target_tokens // _AVG_TURN_TOKENS // n_topics)
    lo, hi = min(_STRETCH_TURNS[0], cap), min(_STRETCH_TURNS[1], cap)
    # The first visit of each topic plants a fixed number of facts, so that every topic has
    # questions (two once the conversation is long enough); later facts follow _FACT_EVERY.
    first_visit_facts = 2 if target_tokens >= 1500 else 1 if target_tokens >= 600 else 0

    order = list(topics)  # first pass: every topic once, in seeded order; then random revisits
    visited: set[str] = set()
    previous: Topic | None = None
    stretches_left_in_session = 0
    while not writer.done():
        if order:
            topic = order.pop(0)
        else:  # revisit another topic, favouring the ones talked about least so far
            candidates = [t for t in topics if t is not previous] or topics
            topic = min(candidates, key=lambda t: writer.turns_per_topic[t.name]
                        + rng.uniform(0, 2 * _STRETCH_TURNS[1]))
        first_visit = topic.name not in visited
        visited.add(topic.name)
        # A new session only if there is room for it: a date line with no turn after it would
        # count towards the target without being rendered.
        if stretches_left_in_session == 0 and (writer.session == 0 or
                                               writer.target - writer.tokens() >= 40):
            writer.new_session()
            stretches_left_in_session = rng.choice((1, 2))  # a session covers one or two topics
        stretches_left_in_session -= 1
        length = rng.randint(lo, hi)
        planned: set[int] = set()
        if first_visit:  # never the opener when the stretch is long enough to avoid it
            slots = range(1, length) if length > 1 else range(length)
            planned = set(rng.sample(slots, min(first_visit_facts, len(slots))))
        for i in range(length):
            if writer.done():
                break
            scheduled = not first_visit or first_visit_facts == 0
            fact = i in planned or (scheduled and i > 0 and writer.fact_due())
            writer.add_turn(topic, opener=(i == 0), fact=fact)
        previous = topic

    meta = {"source": "synthetic", "seed": seed, "topics": [t.name for t in topics]}
    return Conversation(conversation_id, speakers, tuple(writer.turns), tuple(writer.questions),
                        meta)


def iter_corpus(n_conversations: int, target_tokens: int, seed: int,
                n_topics: int = 4) -> Iterator[Conversation]:
    """`n_conversations` conversations 'synth-0000', 'synth-0001', ..., made one at a time (a
    corpus of any size in the memory of one conversation), each from its own sub-seed derived
    from (seed, index), so adding conversations never changes earlier ones."""
    for i in range(n_conversations):
        sub_seed = random.Random(f"synthetic-corpus/{seed}/{i}").getrandbits(32)
        yield make_conversation(f"synth-{i:04d}", target_tokens, sub_seed, n_topics)


def make_corpus(n_conversations: int, target_tokens: int, seed: int,
                n_topics: int = 4) -> list[Conversation]:
    """`iter_corpus`'s conversations, in a list."""
    return list(iter_corpus(n_conversations, target_tokens, seed, n_topics))
