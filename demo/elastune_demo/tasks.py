"""A deterministic suite of small prompt-tuning tasks that Elastune generates itself.

PromptTuner (§6.1) builds 120 tasks from 12 datasets × 10 exclusive partitions. Hub datasets cannot be
downloaded here, so each *family* below plays the role of a dataset and each *partition* is a genuinely
different task of that family: its own schema, vocabulary, transformation, label words or year range.
Partitions are exclusive by construction (the input alone never occurs in two partitions of a family),
which the tests check by brute force.

Pure Python on purpose (no torch): the operator side and benchmarks may import it cheaply.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path

# One string separates input from target everywhere (corpus, tuning, scoring), so a model pretrained on
# the corpus sees the same layout the tuner later feeds it.
SEPARATOR = " →"

Example = dict[str, str]
# Every partition holds at least ~430 distinct inputs; asking for more than a partition holds fails fast.
_MAX_CONSECUTIVE_REPEATS = 5000
_Sampler = Callable[[random.Random], tuple[str, str]]


@dataclass(frozen=True, order=True)
class TaskSpec:
    """One task: a family (the "dataset") and one of its exclusive partitions."""

    family: str
    partition: int

    @property
    def name(self) -> str:
        return f"{self.family}-{self.partition:02d}"


@dataclass(frozen=True)
class Task:
    spec: TaskSpec
    train: list[Example]
    eval: list[Example]
    seed: int

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class _Partition:
    instructions: tuple[str, ...]  # partition-specific phrasings: they pin down *this* task
    sample: _Sampler


@dataclass(frozen=True)
class _Family:
    name: str
    instructions: tuple[str, ...]  # generic phrasings: they describe the family, not the partition
    partitions: tuple[_Partition, ...]


def format_example(input: str, target: str | None = None, instruction: str | None = None) -> str:
    """The text layout shared by pretraining and tuning: `instruction\\ninput → target`.

    With `target=None` it returns the prompt the model should continue (ends with the separator).
    """
    head = f"{instruction}\n" if instruction else ""
    body = f"{input}{SEPARATOR}"
    return head + body if target is None else f"{head}{body} {target}"


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# --------------------------------------------------------------------------------------------- sql
_SQL_SCHEMAS: tuple[tuple[str, tuple[str, str], str, tuple[str, ...], tuple[str, int, int], str], ...] = (
    # table, (text col, text col), categorical col, its values, (numeric col, lo, hi), second numeric col
    (
        "employees",
        ("name", "title"),
        "dept",
        ("sales", "legal", "design", "support"),
        ("salary", 1000, 9000),
        "age",
    ),
    (
        "products",
        ("name", "brand"),
        "category",
        ("toys", "tools", "garden", "kitchen"),
        ("price", 1, 500),
        "stock",
    ),
    (
        "students",
        ("name", "major"),
        "year",
        ("freshman", "sophomore", "junior", "senior"),
        ("score", 0, 100),
        "credits",
    ),
    (
        "flights",
        ("code", "airline"),
        "origin",
        ("paris", "tokyo", "cairo", "lima"),
        ("duration", 30, 900),
        "seats",
    ),
    (
        "books",
        ("title", "author"),
        "genre",
        ("mystery", "poetry", "history", "fantasy"),
        ("pages", 50, 900),
        "edition",
    ),
    (
        "movies",
        ("title", "director"),
        "language",
        ("english", "french", "hindi", "korean"),
        ("runtime", 60, 200),
        "budget",
    ),
    (
        "orders",
        ("id", "customer"),
        "status",
        ("pending", "shipped", "returned", "cancelled"),
        ("total", 5, 999),
        "quantity",
    ),
    ("patients", ("name", "doctor"), "ward", ("north", "south", "east", "west"), ("weight", 3, 150), "age"),
    (
        "cars",
        ("model", "maker"),
        "color",
        ("red", "blue", "black", "white"),
        ("horsepower", 70, 700),
        "mileage",
    ),
    ("songs", ("title", "artist"), "mood", ("calm", "upbeat", "sad", "angry"), ("length", 60, 600), "plays"),
)


def _sql_sampler(schema: tuple) -> _Sampler:
    table, (c1, c2), cat, values, (num, lo, hi), num2 = schema

    def sample(rng: random.Random) -> tuple[str, str]:
        c = rng.choice((c1, c2))
        n = rng.choice((num, num2))
        v = rng.randint(lo, hi)
        val = rng.choice(values)
        k = rng.randint(2, 9)
        templates = (
            (f"list the {c} of all {table}", f"SELECT {c} FROM {table};"),
            (f"show every {c1} and {c2} in {table}", f"SELECT {c1}, {c2} FROM {table};"),
            (
                f"which {table} have {num} above {v}? give the {c}",
                f"SELECT {c} FROM {table} WHERE {num} > {v};",
            ),
            (f"find {table} with {num} below {v}", f"SELECT * FROM {table} WHERE {num} < {v};"),
            (f"how many {table} have {cat} {val}", f"SELECT COUNT(*) FROM {table} WHERE {cat} = '{val}';"),
            (
                f"average {n} of {table} where {cat} is {val}",
                f"SELECT AVG({n}) FROM {table} WHERE {cat} = '{val}';",
            ),
            (f"top {k} {table} by {n}, show {c}", f"SELECT {c} FROM {table} ORDER BY {n} DESC LIMIT {k};"),
            (
                f"largest {n} among {table} with {cat} {val}",
                f"SELECT MAX({n}) FROM {table} WHERE {cat} = '{val}';",
            ),
            (f"{c} of {table} with {num} equal to {v}", f"SELECT {c} FROM {table} WHERE {num} = {v};"),
        )
        return rng.choice(templates)

    return sample


def _sql_family() -> _Family:
    parts = tuple(
        _Partition(
            (
                f"Translate the question into SQL for the table {s[0]}.",
                f"Write a SQL query over {s[0]}({s[1][0]}, {s[1][1]}, {s[2]}, {s[4][0]}, {s[5]}).",
            ),
            _sql_sampler(s),
        )
        for s in _SQL_SCHEMAS
    )
    return _Family(
        "sql",
        (
            "Translate the English question into a SQL query.",
            "Convert the request into SQL.",
            "Write the SQL statement that answers the question.",
            "Turn natural language into a SELECT query.",
            "Answer with a single SQL query ending in a semicolon.",
        ),
        parts,
    )


# -------------------------------------------------------------------------------------------- case
# 260 distinct words, 26 per partition: each partition formats its own vocabulary.
_WORDS = _words(
    """
apple river stone cloud garden window candle bridge forest mirror pencil rocket silver orange button castle
desert engine feather galaxy harbor island jacket kitten ladder meadow needle ocean pillow quiet rabbit
saddle tunnel umbrella valley wagon yellow zebra anchor basket cactus dragon eagle fabric glacier hammer
igloo jungle kettle lantern marble napkin oyster parrot quartz ribbon saucer tiger velvet walnut bamboo
cobalt dolphin ember falcon gravel hazel indigo jasmine kayak lemon magnet nectar olive pepper quill raven
sparrow tulip violet acorn blossom copper daisy echo fossil ginger honey ivory jigsaw koala lagoon maple
nutmeg orbit pebble quiver rhubarb sapphire thistle atlas beacon canyon dune estuary fjord geyser hollow
inlet jetty knoll ledge mesa nook oasis plateau quarry ridge summit tundra alloy bolt cable drill flange
gasket hinge joist kiln lathe mallet nozzle piston rivet sprocket trowel valve winch yoke axle banjo cello
drum flute guitar harp lute oboe piano tuba viola bugle cymbal gong horn lyre organ sitar zither fiddle
almond barley cashew durum fennel guava kale lentil mango nacho oat pecan quince radish squash turnip
wasabi yam zucchini basil alpaca bison cougar donkey ferret gazelle hyena ibex jackal lemur marmot ocelot
panda quokka raccoon skunk tapir vole wombat yak amber bronze crimson denim emerald fuchsia garnet khaki
lilac maroon navy ochre plum rust scarlet teal umber wheat azure beige ankle brow chin elbow finger heel
knee lung palm rib shin spine thumb tongue waist wrist jaw hip calf skull attic balcony cellar chimney
doorway foyer gable hallway kitchen loft pantry porch roof stair terrace vault veranda closet den garage
"""
)

_CASE_TRANSFORMS: tuple[tuple[str, Callable[[list[str]], str], tuple[str, ...]], ...] = (
    (
        "upper",
        lambda w: " ".join(w).upper(),
        ("Rewrite the words in UPPER CASE.", "Capitalize every letter."),
    ),
    (
        "title",
        lambda w: " ".join(x.capitalize() for x in w),
        ("Convert to Title Case.", "Capitalize each word."),
    ),
    ("snake", lambda w: "_".join(w), ("Convert to snake_case.", "Join the words with underscores.")),
    (
        "camel",
        lambda w: w[0] + "".join(x.capitalize() for x in w[1:]),
        ("Convert to camelCase.", "Write the words as one camelCase identifier."),
    ),
    ("kebab", lambda w: "-".join(w), ("Convert to kebab-case.", "Join the words with hyphens.")),
    (
        "pascal",
        lambda w: "".join(x.capitalize() for x in w),
        ("Convert to PascalCase.", "Write the words as one PascalCase class name."),
    ),
    (
        "constant",
        lambda w: "_".join(w).upper(),
        ("Convert to CONSTANT_CASE.", "Upper-case the words and join them with underscores."),
    ),
    ("lower", lambda w: " ".join(w), ("Rewrite the words in lower case.", "Remove all capital letters.")),
    (
        "reverse",
        lambda w: " ".join(reversed(w)),
        ("Reverse the order of the words.", "Say the words backwards."),
    ),
    (
        "acronym",
        lambda w: "".join(x[0] for x in w).upper(),
        ("Make an acronym from the initials.", "Write the capitalized first letter of each word."),
    ),
)


def _case_sampler(index: int, transform: Callable[[list[str]], str]) -> _Sampler:
    vocab = _WORDS[index * 26 : (index + 1) * 26]
    upper_input = index == 7  # the "lower" partition needs something to lower

    def sample(rng: random.Random) -> tuple[str, str]:
        words = [rng.choice(vocab) for _ in range(rng.randint(2, 4))]
        text = " ".join(words)
        return (text.upper() if upper_input else text), transform(words)

    return sample


def _case_family() -> _Family:
    parts = tuple(
        _Partition(instr, _case_sampler(i, fn)) for i, (_, fn, instr) in enumerate(_CASE_TRANSFORMS)
    )
    return _Family(
        "case",
        (
            "Reformat the text.",
            "Change the casing and formatting of the words.",
            "Rewrite the phrase in the required style.",
            "Apply the text transformation.",
            "Format the words as requested.",
        ),
        parts,
    )


# ------------------------------------------------------------------------------------------- arith
def _arith_samplers() -> tuple[tuple[_Sampler, tuple[str, ...]], ...]:
    def add2(r: random.Random) -> tuple[str, str]:
        a, b = r.randint(10, 99), r.randint(10, 99)
        return f"{a} + {b} =", str(a + b)

    def sub2(r: random.Random) -> tuple[str, str]:
        a, b = sorted((r.randint(10, 99), r.randint(10, 99)), reverse=True)
        return f"{a} - {b} =", str(a - b)

    def mul12(r: random.Random) -> tuple[str, str]:
        a, b = r.randint(2, 9), r.randint(10, 99)
        return f"{a} * {b} =", str(a * b)

    def add111(r: random.Random) -> tuple[str, str]:
        a, b, c = r.randint(1, 9), r.randint(1, 9), r.randint(1, 9)
        return f"{a} + {b} + {c} =", str(a + b + c)

    def add3(r: random.Random) -> tuple[str, str]:
        a, b = r.randint(100, 999), r.randint(100, 999)
        return f"{a} + {b} =", str(a + b)

    def sub3(r: random.Random) -> tuple[str, str]:
        a, b = sorted((r.randint(100, 999), r.randint(100, 999)), reverse=True)
        return f"{a} - {b} =", str(a - b)

    def muladd(r: random.Random) -> tuple[str, str]:
        a, b, c = r.randint(1, 9), r.randint(1, 9), r.randint(1, 9)
        return f"{a} * {b} + {c} =", str(a * b + c)

    def paren(r: random.Random) -> tuple[str, str]:
        a, b, c = r.randint(1, 9), r.randint(1, 9), r.randint(1, 9)
        return f"({a} + {b}) * {c} =", str((a + b) * c)

    def div(r: random.Random) -> tuple[str, str]:
        b, q = r.randint(2, 9), r.randint(2, 99)
        return f"{b * q} / {b} =", str(q)

    def mod(r: random.Random) -> tuple[str, str]:
        a, b = r.randint(10, 99), r.randint(2, 9)
        return f"{a} mod {b} =", str(a % b)

    return (
        (add2, ("Add the two-digit numbers.", "Compute the sum of two numbers.")),
        (sub2, ("Subtract the second two-digit number from the first.", "Compute the difference.")),
        (mul12, ("Multiply the one-digit number by the two-digit number.", "Compute the product.")),
        (add111, ("Add the three digits.", "Sum the three small numbers.")),
        (add3, ("Add the three-digit numbers.", "Compute the sum of two large numbers.")),
        (sub3, ("Subtract the three-digit numbers.", "Compute the difference of large numbers.")),
        (muladd, ("Multiply, then add the last number.", "Evaluate the product plus a digit.")),
        (paren, ("Add the numbers in parentheses, then multiply.", "Evaluate the bracketed expression.")),
        (div, ("Divide the numbers exactly.", "Compute the quotient.")),
        (mod, ("Give the remainder of the division.", "Compute the number modulo the divisor.")),
    )


def _arith_family() -> _Family:
    return _Family(
        "arith",
        (
            "Solve the arithmetic problem.",
            "Compute the result of the expression.",
            "Give the numeric answer.",
            "Evaluate the math expression.",
            "Do the calculation and answer with a number.",
        ),
        tuple(_Partition(instr, fn) for fn, instr in _arith_samplers()),
    )


# ---------------------------------------------------------------------------------------- classify
# (label words → cue words), subjects, templates with {s} subject, {a}/{b} two cues of the same label.
_CLASSIFY: tuple[
    tuple[dict[str, tuple[str, ...]], tuple[str, ...], tuple[str, ...], tuple[str, ...]], ...
] = (
    (
        {
            "positive": (
                "brilliant",
                "moving",
                "funny",
                "gripping",
                "charming",
                "superb",
                "clever",
                "stunning",
            ),
            "negative": ("dull", "boring", "clumsy", "predictable", "tedious", "shallow", "messy", "bland"),
        },
        ("the film", "the movie", "this picture", "the sequel", "the screenplay", "the cast"),
        ("{s} was {a} and {b}", "honestly {s} felt {a}, even {b}", "critics call {s} {a} but {b}"),
        ("Classify the movie review as positive or negative.", "Is this film review positive or negative?"),
    ),
    (
        {
            "good": ("delicious", "fresh", "friendly", "tasty", "warm", "generous", "crisp", "lovely"),
            "bad": ("cold", "greasy", "rude", "stale", "salty", "slow", "soggy", "burnt"),
        },
        ("the soup", "our waiter", "the pasta", "the dessert", "the bread", "the curry"),
        ("at dinner {s} was {a} and {b}", "{s} arrived {a} and {b}", "we found {s} {a}, also {b}"),
        ("Was the restaurant visit good or bad?", "Rate the dining experience as good or bad."),
    ),
    (
        {
            "sports": (
                "striker",
                "coach",
                "league",
                "stadium",
                "marathon",
                "goalkeeper",
                "referee",
                "tournament",
            ),
            "politics": (
                "senator",
                "parliament",
                "ballot",
                "minister",
                "campaign",
                "embassy",
                "treaty",
                "governor",
            ),
            "science": (
                "telescope",
                "molecule",
                "laboratory",
                "genome",
                "fossil",
                "vaccine",
                "particle",
                "satellite",
            ),
            "business": (
                "startup",
                "merger",
                "investor",
                "shareholder",
                "revenue",
                "factory",
                "retailer",
                "dividend",
            ),
        },
        ("breaking", "today", "update", "exclusive", "tonight", "analysis"),
        ("{s}: {a} meets {b}", "{s}: new {a} questions the {b}", "{s} headline, {a} and {b} in focus"),
        (
            "Which topic is the headline about: sports, politics, science or business?",
            "Label the news topic.",
        ),
    ),
    (
        {
            "great": ("durable", "reliable", "sturdy", "quiet", "powerful", "handy", "sleek", "solid"),
            "awful": ("flimsy", "broken", "noisy", "useless", "cheap", "faulty", "leaky", "fragile"),
        },
        ("this blender", "the charger", "these headphones", "the vacuum", "my kettle", "the drill"),
        ("bought {s}, it is {a} and {b}", "{s} turned out {a} and {b}", "five weeks in, {s} is {a}, {b}"),
        ("Is the product review great or awful?", "Rate this gadget review as great or awful."),
    ),
    (
        {
            "sunny": ("clear skies", "bright sunshine", "no clouds", "a heat wave", "blue skies", "dry air"),
            "rainy": ("heavy showers", "a downpour", "drizzle", "thunderstorms", "flooding", "wet roads"),
            "snowy": ("blizzards", "snowfall", "frost", "icy roads", "sleet", "deep drifts"),
        },
        ("oslo", "madrid", "denver", "nairobi", "quebec", "perth"),
        ("forecast for {s}: {a} and {b}", "{s} expects {a} with {b}", "tomorrow in {s}, {a} then {b}"),
        ("Is the forecast sunny, rainy or snowy?", "Classify the weather report."),
    ),
    (
        {
            "mammal": ("tiger", "whale", "otter", "bat", "camel", "beaver", "zebra", "lemur"),
            "bird": ("parrot", "eagle", "owl", "sparrow", "pelican", "heron", "penguin", "robin"),
            "fish": ("salmon", "trout", "shark", "tuna", "carp", "cod", "eel", "perch"),
            "reptile": ("lizard", "cobra", "turtle", "gecko", "iguana", "python", "viper", "crocodile"),
        },
        ("river", "forest", "harbor", "cliff", "marsh", "meadow"),
        ("a {a} was seen near the {s}", "by the {s} we spotted a {a}", "the {s} is home to a {a}"),
        ("Is the animal a mammal, bird, fish or reptile?", "Name the animal class."),
    ),
    (
        {
            "joy": ("delighted", "thrilled", "cheerful", "overjoyed", "glad", "elated"),
            "anger": ("furious", "annoyed", "irritated", "outraged", "livid", "enraged"),
            "fear": ("terrified", "anxious", "scared", "nervous", "frightened", "panicked"),
            "sadness": ("heartbroken", "gloomy", "miserable", "lonely", "sorrowful", "depressed"),
        },
        (
            "the letter arrived",
            "my brother called",
            "the meeting ended",
            "the train stopped",
            "the lights went out",
            "we moved house",
            "the results came",
            "the dog barked",
        ),
        ("i felt {a} when {s}", "when {s} i was {a}", "{a}, that is how i felt after {s}"),
        ("Which emotion is expressed: joy, anger, fear or sadness?", "Name the feeling in the sentence."),
    ),
    (
        {
            "spam": (
                "a free cruise",
                "cash prizes",
                "a gift card",
                "cheap pills",
                "a lottery win",
                "bonus credit",
            ),
            "ham": (
                "the project notes",
                "lunch plans",
                "the school trip",
                "our budget",
                "the lease",
                "dad's birthday",
            ),
        },
        ("hi", "dear user", "hello", "fyi", "reminder", "quick note"),
        ("{s}, about {a} and {b}: reply soon", "{s} - {a}, {b} inside", "{s}! click for {a} or {b} now"),
        ("Is this message spam or ham?", "Detect whether the email is spam."),
    ),
    (
        {
            "fruit": ("figs", "plums", "cherries", "apricots", "grapes", "peaches"),
            "vegetable": ("carrots", "leeks", "spinach", "beets", "celery", "onions"),
            "grain": ("rice", "millet", "rye", "quinoa", "oats", "barley"),
            "dairy": ("yogurt", "cheddar", "butter", "cream", "ricotta", "kefir"),
        },
        ("the stew", "a salad", "the pie", "the casserole", "a smoothie", "the bowl"),
        ("add {a} to {s}", "{s} needs more {a}", "top {s} with {a}"),
        ("Which food group is the ingredient: fruit, vegetable, grain or dairy?", "Name the food group."),
    ),
    (
        {
            "strings": ("violin", "cello", "harp", "banjo", "mandolin", "ukulele"),
            "brass": ("trumpet", "trombone", "tuba", "bugle", "cornet", "euphonium"),
            "percussion": ("snare", "timpani", "bongo", "xylophone", "tambourine", "triangle"),
            "keyboard": ("piano", "organ", "harpsichord", "accordion", "celesta", "synthesizer"),
        },
        ("the concert", "the parade", "the wedding", "the recital", "the festival", "the rehearsal"),
        ("she played the {a} at {s}", "at {s} the {a} was too loud", "{s} opened with a {a} solo"),
        ("Which instrument family: strings, brass, percussion or keyboard?", "Name the instrument section."),
    ),
)


def _classify_sampler(
    labels: dict[str, tuple[str, ...]], subjects: Sequence[str], templates: Sequence[str]
) -> _Sampler:
    def sample(rng: random.Random) -> tuple[str, str]:
        label = rng.choice(sorted(labels))
        a, b = rng.sample(labels[label], 2)
        return rng.choice(templates).format(s=rng.choice(subjects), a=a, b=b), label

    return sample


def _classify_family() -> _Family:
    parts = tuple(
        _Partition(instr, _classify_sampler(labels, subjects, templates))
        for labels, subjects, templates, instr in _CLASSIFY
    )
    return _Family(
        "classify",
        (
            "Classify the text and answer with the label word.",
            "Which category does the text belong to?",
            "Read the sentence and give its label.",
            "Assign the correct class to the text.",
            "Answer with one word: the category.",
        ),
        parts,
    )


# ----------------------------------------------------------------------------------------- listops
_LIST_WORDS = (
    ("amber", "birch", "cedar", "elm", "fir", "hemlock", "juniper", "larch", "maple", "oak", "pine", "yew"),
    ("cat", "dog", "cow", "pig", "hen", "goat", "duck", "ram", "ox", "mule", "ewe", "colt"),
    ("red", "blue", "green", "pink", "gray", "gold", "cyan", "tan", "lime", "mauve", "peach", "sand"),
)


def _listops_samplers() -> tuple[tuple[_Sampler, tuple[str, ...]], ...]:
    def nums(r: random.Random, lo: int, hi: int, k_lo: int = 3, k_hi: int = 6) -> list[int]:
        return [r.randint(lo, hi) for _ in range(r.randint(k_lo, k_hi))]

    def sort_asc(r: random.Random) -> tuple[str, str]:
        xs = nums(r, 10, 99)
        return " ".join(map(str, xs)), " ".join(map(str, sorted(xs)))

    def sort_desc(r: random.Random) -> tuple[str, str]:
        xs = nums(r, 100, 999)
        return " ".join(map(str, xs)), " ".join(map(str, sorted(xs, reverse=True)))

    def reverse_letters(r: random.Random) -> tuple[str, str]:
        xs = [chr(r.randint(97, 122)) for _ in range(r.randint(3, 7))]
        return " ".join(xs), " ".join(reversed(xs))

    def sort_alpha(r: random.Random) -> tuple[str, str]:
        xs = r.sample(_LIST_WORDS[0], r.randint(3, 5))
        return " ".join(xs), " ".join(sorted(xs))

    def max4(r: random.Random) -> tuple[str, str]:
        xs = nums(r, 1000, 9999, 3, 5)
        return " ".join(map(str, xs)), str(max(xs))

    def min1(r: random.Random) -> tuple[str, str]:
        xs = nums(r, 0, 9, 4, 7)
        return " ".join(map(str, xs)), str(min(xs))

    def count(r: random.Random) -> tuple[str, str]:
        xs = [r.choice(_LIST_WORDS[1]) for _ in range(r.randint(2, 8))]
        return " ".join(xs), str(len(xs))

    def last(r: random.Random) -> tuple[str, str]:
        xs = [r.choice(_LIST_WORDS[2]) for _ in range(r.randint(3, 6))]
        return " ".join(xs), xs[-1]

    def dedupe(r: random.Random) -> tuple[str, str]:
        xs = [chr(r.randint(65, 72)) for _ in range(r.randint(4, 8))]
        return " ".join(xs), " ".join(dict.fromkeys(xs))

    def evens(r: random.Random) -> tuple[str, str]:
        xs = nums(r, 10, 99, 4, 6)
        return ", ".join(map(str, xs)), ", ".join(str(x) for x in xs if x % 2 == 0) or "none"

    return (
        (sort_asc, ("Sort the numbers in ascending order.", "Order the numbers from smallest to largest.")),
        (sort_desc, ("Sort the numbers in descending order.", "Order the numbers from largest to smallest.")),
        (reverse_letters, ("Reverse the list of letters.", "Write the letters in reverse order.")),
        (sort_alpha, ("Sort the words alphabetically.", "Put the tree names in alphabetical order.")),
        (max4, ("Give the largest number.", "Find the maximum of the list.")),
        (min1, ("Give the smallest digit.", "Find the minimum of the list.")),
        (count, ("Count the words in the list.", "How many animals are listed?")),
        (last, ("Give the last item of the list.", "Which color comes last?")),
        (dedupe, ("Remove duplicate letters, keeping first occurrences.", "List each letter once.")),
        (evens, ("Keep only the even numbers.", "Filter the list to even numbers.")),
    )


def _listops_family() -> _Family:
    return _Family(
        "listops",
        (
            "Apply the list operation.",
            "Transform the list as required.",
            "Process the sequence of items.",
            "Answer the question about the list.",
            "Manipulate the list and write the result.",
        ),
        tuple(_Partition(instr, fn) for fn, instr in _listops_samplers()),
    )


# ------------------------------------------------------------------------------------------- units
_UNITS = (
    ("km", "m", 1000, "kilometres to metres"),
    ("m", "cm", 100, "metres to centimetres"),
    ("kg", "g", 1000, "kilograms to grams"),
    ("h", "min", 60, "hours to minutes"),
    ("min", "s", 60, "minutes to seconds"),
    ("l", "ml", 1000, "litres to millilitres"),
    ("ft", "in", 12, "feet to inches"),
    ("days", "hours", 24, "days to hours"),
    ("weeks", "days", 7, "weeks to days"),
    ("yd", "ft", 3, "yards to feet"),
)


def _units_sampler(src: str, dst: str, factor: int) -> _Sampler:
    def sample(rng: random.Random) -> tuple[str, str]:
        v = rng.randint(1, 999)
        return f"{v} {src}", f"{v * factor} {dst}"

    return sample


def _units_family() -> _Family:
    return _Family(
        "units",
        (
            "Convert the quantity to the other unit.",
            "Do the unit conversion.",
            "Express the measurement in the smaller unit.",
            "Change the units of the value.",
            "Convert and write the number with its new unit.",
        ),
        tuple(
            _Partition((f"Convert {words}.", f"Express {src} in {dst}."), _units_sampler(src, dst, f))
            for src, dst, f, words in _UNITS
        ),
    )


# ------------------------------------------------------------------------------------------- dates
_MONTHS = _words("January February March April May June July August September October November December")
_DATE_FORMATS: dict[str, Callable[[date], str]] = {
    "iso": lambda d: d.isoformat(),
    "us": lambda d: f"{d.month:02d}/{d.day:02d}/{d.year}",
    "eu": lambda d: f"{d.day:02d}.{d.month:02d}.{d.year}",
    "long": lambda d: f"{_MONTHS[d.month - 1]} {d.day}, {d.year}",
    "short": lambda d: f"{d.day} {_MONTHS[d.month - 1][:3]} {d.year}",
    "compact": lambda d: f"{d.year}{d.month:02d}{d.day:02d}",
    "dmy": lambda d: f"{d.day} {_MONTHS[d.month - 1]} {d.year}",
}
_DATE_NAMES = {
    "iso": "YYYY-MM-DD",
    "us": "MM/DD/YYYY",
    "eu": "DD.MM.YYYY",
    "long": "Month D, YYYY",
    "short": "D Mon YYYY",
    "compact": "YYYYMMDD",
    "dmy": "D Month YYYY",
}
# (input format, output format); partition p draws dates from the decade 1900 + 10p, so inputs of two
# partitions can never coincide even where input formats repeat.
_DATE_PAIRS = (
    ("iso", "long"),
    ("long", "iso"),
    ("us", "iso"),
    ("iso", "us"),
    ("eu", "long"),
    ("short", "iso"),
    ("compact", "long"),
    ("iso", "eu"),
    ("us", "short"),
    ("iso", "dmy"),
)


def _dates_sampler(index: int, src: str, dst: str) -> _Sampler:
    start = date(1900 + 10 * index, 1, 1)
    span = (date(1910 + 10 * index, 1, 1) - start).days

    def sample(rng: random.Random) -> tuple[str, str]:
        d = start + timedelta(days=rng.randrange(span))
        return _DATE_FORMATS[src](d), _DATE_FORMATS[dst](d)

    return sample


def _dates_family() -> _Family:
    return _Family(
        "dates",
        (
            "Reformat the date.",
            "Rewrite the date in the other format.",
            "Convert the date notation.",
            "Change how the date is written.",
            "Write the same date in the target format.",
        ),
        tuple(
            _Partition(
                (
                    f"Convert the date from {_DATE_NAMES[s]} to {_DATE_NAMES[d]}.",
                    f"Write the date as {_DATE_NAMES[d]}.",
                ),
                _dates_sampler(i, s, d),
            )
            for i, (s, d) in enumerate(_DATE_PAIRS)
        ),
    )


# ----------------------------------------------------------------------------------------- extract
_FIRST = ("ana", "ben", "chen", "dara", "eli", "fatima", "goran", "hana", "ivan", "jun", "kofi", "lena")
_CITY = ("lima", "oslo", "pune", "kyiv", "doha", "rome", "lagos", "quito", "seoul", "turin", "hanoi", "bern")
_EXTRACT: tuple[tuple[str, tuple[tuple[str, Callable[[random.Random], str]], ...], str], ...] = (
    (
        "person",
        (
            ("name", lambda r: r.choice(_FIRST)),
            ("city", lambda r: r.choice(_CITY)),
            ("age", lambda r: str(r.randint(18, 90))),
        ),
        "city",
    ),
    (
        "book",
        (
            (
                "title",
                lambda r: r.choice(
                    ("dune", "emma", "ulysses", "beloved", "rebecca", "heidi", "matilda", "ivanhoe")
                ),
            ),
            (
                "author",
                lambda r: r.choice(
                    ("austen", "joyce", "morrison", "herbert", "spyri", "dahl", "scott", "woolf")
                ),
            ),
            ("year", lambda r: str(r.randint(1800, 2020))),
        ),
        "author",
    ),
    (
        "flight",
        (
            ("flight", lambda r: f"{r.choice(('ba', 'lh', 'af', 'ek', 'qf'))}{r.randint(100, 999)}"),
            ("gate", lambda r: f"{r.choice('abcdef')}{r.randint(1, 40)}"),
            ("departs", lambda r: f"{r.randint(0, 23):02d}:{r.choice(('00', '15', '30', '45'))}"),
        ),
        "gate",
    ),
    (
        "order",
        (
            ("order", lambda r: f"#{r.randint(1000, 9999)}"),
            ("item", lambda r: r.choice(("lamp", "desk", "rug", "chair", "shelf", "sofa", "stool", "bench"))),
            ("total", lambda r: f"${r.randint(5, 900)}"),
        ),
        "total",
    ),
    (
        "car",
        (
            ("plate", lambda r: f"{r.choice('KLMNP')}{r.choice('QRSTU')}-{r.randint(100, 999)}"),
            ("paint", lambda r: r.choice(("silver", "black", "white", "red", "blue", "green"))),
            ("make", lambda r: r.choice(("volvo", "fiat", "honda", "kia", "ford", "skoda", "mazda", "seat"))),
        ),
        "make",
    ),
    (
        "hotel",
        (
            ("guest", lambda r: r.choice(_FIRST)),
            ("room", lambda r: str(r.randint(101, 999))),
            ("nights", lambda r: str(r.randint(1, 14))),
        ),
        "room",
    ),
    (
        "course",
        (
            (
                "course",
                lambda r: r.choice(("algebra", "biology", "chemistry", "drawing", "economics", "french")),
            ),
            (
                "teacher",
                lambda r: r.choice(("smith", "garcia", "kim", "novak", "okafor", "patel", "rossi", "sato")),
            ),
            ("credits", lambda r: str(r.randint(1, 10))),
        ),
        "teacher",
    ),
    (
        "pet",
        (
            ("pet", lambda r: r.choice(("rex", "luna", "milo", "bella", "coco", "oscar", "nala", "toby"))),
            ("species", lambda r: r.choice(("dog", "cat", "rabbit", "parrot", "hamster", "turtle"))),
            ("owner", lambda r: r.choice(_FIRST)),
        ),
        "owner",
    ),
    (
        "device",
        (
            ("host", lambda r: r.choice(("alpha", "bravo", "delta", "echo", "kilo", "tango"))),
            ("ip", lambda r: f"10.{r.randint(0, 255)}.{r.randint(0, 255)}.{r.randint(1, 254)}"),
            ("port", lambda r: str(r.choice((22, 80, 443, 5432, 6379, 8080, 9090)))),
        ),
        "ip",
    ),
    (
        "recipe",
        (
            ("dish", lambda r: r.choice(("ramen", "paella", "tacos", "risotto", "curry", "goulash", "pho"))),
            ("cuisine", lambda r: r.choice(("japanese", "spanish", "mexican", "italian", "indian", "thai"))),
            ("minutes", lambda r: str(r.randint(5, 180))),
        ),
        "minutes",
    ),
)


def _extract_sampler(fields: tuple[tuple[str, Callable[[random.Random], str]], ...], wanted: str) -> _Sampler:
    def sample(rng: random.Random) -> tuple[str, str]:
        values = {k: gen(rng) for k, gen in fields}
        order = list(values)
        rng.shuffle(order)  # the wanted field moves around, so position alone is not the answer
        return "; ".join(f"{k}: {values[k]}" for k in order), values[wanted]

    return sample


def _extract_family() -> _Family:
    return _Family(
        "extract",
        (
            "Extract the requested field from the record.",
            "Read the record and return one value.",
            "Find the relevant value in the key-value pairs.",
            "Pull out the field that matters.",
            "Answer with the value of the right key.",
        ),
        tuple(
            _Partition(
                (f"Extract the {wanted} from the {kind} record.", f"What is the {wanted}?"),
                _extract_sampler(fields, wanted),
            )
            for kind, fields, wanted in _EXTRACT
        ),
    )


# ------------------------------------------------------------------------------------------- suite
_FAMILIES: dict[str, _Family] = {
    f.name: f
    for f in (
        _sql_family(),
        _case_family(),
        _arith_family(),
        _classify_family(),
        _listops_family(),
        _units_family(),
        _dates_family(),
        _extract_family(),
    )
}
FAMILIES: tuple[str, ...] = tuple(_FAMILIES)


def _family(name: str) -> _Family:
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown task family {name!r}; known: {', '.join(FAMILIES)}") from None


def _partition(spec: TaskSpec) -> _Partition:
    fam = _family(spec.family)
    if not 0 <= spec.partition < len(fam.partitions):
        raise ValueError(f"{spec.family} has partitions 0..{len(fam.partitions) - 1}, not {spec.partition}")
    return fam.partitions[spec.partition]


def list_tasks(families: Iterable[str] | None = None) -> list[TaskSpec]:
    """Every task of the suite (or of the given families), in a stable order."""
    names = FAMILIES if families is None else tuple(families)
    return [TaskSpec(n, p) for n in names for p in range(len(_family(n).partitions))]


def family_instructions(family: str) -> list[str]:
    """Generic instructions describing a family; candidates for initial prompts (Prompt Bank)."""
    return list(_family(family).instructions)


def partition_instructions(spec: TaskSpec) -> list[str]:
    """Instructions that pin down one partition (schema, transform, label words, formats)."""
    return list(_partition(spec).instructions)


def sample_examples(spec: TaskSpec, n: int, seed: int) -> list[Example]:
    """`n` examples with pairwise distinct inputs, deterministic in (spec, seed)."""
    sampler = _partition(spec).sample
    # A string seed is hashed with SHA-512 by `random`, stable across processes (unlike hash()).
    rng = random.Random(f"elastune-tiny/{spec.name}/{seed}")
    seen: dict[str, str] = {}
    misses = 0
    # Give up only after a long run of repeats: the partition's pool is then (nearly) exhausted.
    while len(seen) < n and misses < _MAX_CONSECUTIVE_REPEATS:
        x, y = sampler(rng)
        if x in seen:
            misses += 1
        else:
            seen[x], misses = y, 0
    if len(seen) < n:
        raise ValueError(f"{spec.name}: could only draw {len(seen)} distinct inputs, {n} requested")
    return [{"input": x, "target": y} for x, y in seen.items()]


def make_task(spec: TaskSpec, n_train: int = 128, n_eval: int = 32, seed: int = 0) -> Task:
    """A task with disjoint train and eval examples (distinct inputs), deterministic in `seed`."""
    if n_train < 0 or n_eval < 0:
        raise ValueError("n_train and n_eval must be >= 0")
    examples = sample_examples(spec, n_train + n_eval, seed)
    return Task(spec=spec, train=examples[:n_train], eval=examples[n_train:], seed=seed)


def write_jsonl(records: Iterable[Example], path: str | Path) -> Path:
    """Write records as JSONL (the TuningJob `dataset` format: one {"input", "target"} per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[Example]:
    with Path(path).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
