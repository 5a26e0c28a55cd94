"""The Prompt Bank's candidate set, written by the project itself (no copied prompt collections).

PromptTuner (§4.3.1) gathers thousands of public prompts; we cannot download any, so the candidates are
generated from Elastune's own phrasings: for every task of the tiny suite (tasks.py) a handful of
hand-written *cores* (what to do, in imperative form) are combined with generic *frames* ("Please …",
"Task: …", "Read the input and …"), plus family-level descriptions, the suite's own instructions verbatim
and ~60 tasks *beyond* the suite (summaries, translation, trivia, unit conversions the suite lacks …) as
realistic distractors. Everything is deterministic in `seed`, pure Python, and cheap (< 50 ms).
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from elastune_demo import tasks as T

__all__ = ["DEFAULT_SIZE", "FRAMES", "candidate_pool", "default_candidates", "task_cores"]

#: Matches the Prompt Bank capacity (§6.3 "we set the maximum size as 3,000").
DEFAULT_SIZE = 3000

# Frames turn an imperative core ("convert km to m") into a prompt. "{C}" is the core capitalised.
FRAMES: tuple[str, ...] = (
    "{C}.",
    "Please {c}.",
    "Task: {c}.",
    "Instruction: {c}.",
    "{C}. Answer with the result only.",
    "Read the input and {c}.",
    "Your job is to {c}.",
    "{C}:",
    "Carefully {c}.",
    "Given the input, {c}.",
    "{C}. Be precise.",
    "Now {c}.",
    "In one line, {c}.",
    "You will {c}.",
    "Goal: {c}.",
    "We need you to {c}.",
    "{C} for the following input.",
    "Step 1: read the input. Step 2: {c}.",
    "Quickly {c}.",
    "{C}, then stop.",
    "Exercise: {c}.",
    "Below is an input. {C}.",
)
_QUESTION_FRAMES: tuple[str, ...] = ("{C}", "Question: {C}", "{C} Answer briefly.", "Q: {C} A:")

# ------------------------------------------------------------------------------- per-task cores
_SQL_TABLES = (
    ("employees", "name, title, dept, salary, age"),
    ("products", "name, brand, category, price, stock"),
    ("students", "name, major, year, score, credits"),
    ("flights", "code, airline, origin, duration, seats"),
    ("books", "title, author, genre, pages, edition"),
    ("movies", "title, director, language, runtime, budget"),
    ("orders", "id, customer, status, total, quantity"),
    ("patients", "name, doctor, ward, weight, age"),
    ("cars", "model, maker, color, horsepower, mileage"),
    ("songs", "title, artist, mood, length, plays"),
)
_CASE_STYLES = (
    ("UPPER CASE", ("capitalize every letter", "shout the words in capitals")),
    ("Title Case", ("capitalize the first letter of each word", "start every word with a capital")),
    ("snake_case", ("join the words with underscores", "write the words as one snake_case name")),
    (
        "camelCase",
        ("write the words as one camelCase identifier", "glue the words, capitalizing all but the first"),
    ),
    ("kebab-case", ("join the words with hyphens", "link the words with dashes")),
    ("PascalCase", ("write the words as one PascalCase class name", "glue the words, each capitalized")),
    ("CONSTANT_CASE", ("upper-case the words and join them with underscores", "make a CONSTANT_CASE name")),
    ("lower case", ("remove all capital letters", "write every letter in lower case")),
    ("reverse order", ("reverse the order of the words", "say the words backwards, last word first")),
    ("an acronym", ("make an acronym from the initials", "write the capitalized first letter of each word")),
)
_ARITH_OPS = (
    (
        "add the two two-digit numbers",
        "compute the sum of two two-digit numbers",
        "find a + b for two-digit a and b",
    ),
    (
        "subtract the second two-digit number from the first",
        "compute the difference of two two-digit numbers",
        "find a - b",
    ),
    (
        "multiply the one-digit number by the two-digit number",
        "compute the product of a digit and a two-digit number",
        "find a times b",
    ),
    ("add the three digits", "sum the three small numbers", "total the three single digits"),
    (
        "add the three-digit numbers",
        "compute the sum of two large numbers",
        "find the total of two three-digit numbers",
    ),
    (
        "subtract the three-digit numbers",
        "compute the difference of large numbers",
        "take the second three-digit number from the first",
    ),
    ("multiply, then add the last number", "evaluate the product plus a digit", "compute a times b plus c"),
    (
        "add the numbers in parentheses, then multiply",
        "evaluate the bracketed expression",
        "compute (a + b) times c",
    ),
    ("divide the numbers exactly", "compute the quotient", "find how many times the divisor fits"),
    ("give the remainder of the division", "compute the number modulo the divisor", "find a mod b"),
)
_CLASSIFY = (
    ("movie review", ("positive", "negative")),
    ("restaurant visit", ("good", "bad")),
    ("news headline", ("sports", "politics", "science", "business")),
    ("product review", ("great", "awful")),
    ("weather forecast", ("sunny", "rainy", "snowy")),
    ("animal", ("mammal", "bird", "fish", "reptile")),
    ("sentence's emotion", ("joy", "anger", "fear", "sadness")),
    ("email", ("spam", "ham")),
    ("ingredient's food group", ("fruit", "vegetable", "grain", "dairy")),
    ("instrument family", ("strings", "brass", "percussion", "keyboard")),
)
_LISTOPS = (
    (
        "sort the numbers in ascending order",
        "order the numbers from smallest to largest",
        "arrange the numbers in increasing order",
    ),
    (
        "sort the numbers in descending order",
        "order the numbers from largest to smallest",
        "arrange the numbers in decreasing order",
    ),
    (
        "reverse the list of letters",
        "write the letters in reverse order",
        "read the letters from right to left",
    ),
    (
        "sort the words alphabetically",
        "put the tree names in alphabetical order",
        "order the words from a to z",
    ),
    ("give the largest number", "find the maximum of the list", "pick the biggest number"),
    ("give the smallest digit", "find the minimum of the list", "pick the lowest digit"),
    ("count the words in the list", "count how many animals are listed", "give the number of items"),
    ("give the last item of the list", "name the color that comes last", "return the final word"),
    ("remove duplicate letters, keeping first occurrences", "list each letter once", "drop repeated letters"),
    ("keep only the even numbers", "filter the list to even numbers", "drop the odd numbers"),
)
_UNITS = (
    ("kilometres", "metres", "km", "m"),
    ("metres", "centimetres", "m", "cm"),
    ("kilograms", "grams", "kg", "g"),
    ("hours", "minutes", "h", "min"),
    ("minutes", "seconds", "min", "s"),
    ("litres", "millilitres", "l", "ml"),
    ("feet", "inches", "ft", "in"),
    ("days", "hours", "days", "hours"),
    ("weeks", "days", "weeks", "days"),
    ("yards", "feet", "yd", "ft"),
)
_DATES = (
    ("YYYY-MM-DD", "Month D, YYYY"),
    ("Month D, YYYY", "YYYY-MM-DD"),
    ("MM/DD/YYYY", "YYYY-MM-DD"),
    ("YYYY-MM-DD", "MM/DD/YYYY"),
    ("DD.MM.YYYY", "Month D, YYYY"),
    ("D Mon YYYY", "YYYY-MM-DD"),
    ("YYYYMMDD", "Month D, YYYY"),
    ("YYYY-MM-DD", "DD.MM.YYYY"),
    ("MM/DD/YYYY", "D Mon YYYY"),
    ("YYYY-MM-DD", "D Month YYYY"),
)
_EXTRACT = (
    ("person", "city"),
    ("book", "author"),
    ("flight", "gate"),
    ("order", "total"),
    ("car", "make"),
    ("hotel", "room"),
    ("course", "teacher"),
    ("pet", "owner"),
    ("device", "ip"),
    ("recipe", "minutes"),
)


def _or(words: tuple[str, ...]) -> str:
    return ", ".join(words[:-1]) + " or " + words[-1]


def task_cores(spec: T.TaskSpec) -> list[str]:
    """Imperative descriptions of one suite task (lower-case start; a trailing "?" marks a question)."""
    i, fam = spec.partition, spec.family
    if fam == "sql":
        t, cols = _SQL_TABLES[i]
        return [
            f"translate the question into SQL for the table {t}",
            f"write a SQL query over {t}({cols})",
            f"turn the request about {t} into a SELECT statement",
            f"answer the question about {t} with one SQL query",
            f"convert the English request into SQL on the {t} table",
            f"generate SQL that queries {t}",
        ]
    if fam == "case":
        style, extra = _CASE_STYLES[i]
        return [
            f"rewrite the words in {style}",
            f"convert the phrase to {style}",
            f"format the words as {style}",
            *extra,
        ]
    if fam == "arith":
        return [*_ARITH_OPS[i], "solve: " + _ARITH_OPS[i][0]]
    if fam == "classify":
        domain, labels = _CLASSIFY[i]
        return [
            f"classify the {domain} as {_or(labels)}",
            f"label the {domain}: {', '.join(labels)}",
            f"decide whether the {domain} is {_or(labels)}",
            f"answer {_or(labels)} for the {domain}",
            f"is the {domain} {_or(labels)}?",
            f"which label fits the {domain}: {', '.join(labels)}?",
        ]
    if fam == "listops":
        return list(_LISTOPS[i])
    if fam == "units":
        a, b, sa, sb = _UNITS[i]
        return [
            f"convert {a} to {b}",
            f"express {sa} in {sb}",
            f"change the {a} value into {b}",
            f"turn {sa} into {sb}",
            f"how many {b} is the given number of {a}?",
        ]
    if fam == "dates":
        s, d = _DATES[i]
        return [
            f"convert the date from {s} to {d}",
            f"write the date as {d}",
            f"rewrite the {s} date in {d} format",
            f"change the date format to {d}",
            f"reformat {s} dates as {d}",
        ]
    if fam == "extract":
        kind, field = _EXTRACT[i]
        return [
            f"extract the {field} from the {kind} record",
            f"return the {field} field of the {kind}",
            f"find the {field} in the {kind} record",
            f"give only the value of {field}",
            f"what is the {field}?",
        ]
    raise ValueError(f"no prompt cores for task family {fam!r}")


_FAMILY_CORES: dict[str, tuple[str, ...]] = {
    "sql": (
        "write SQL for the question",
        "translate English into a database query",
        "produce a SELECT query",
    ),
    "case": (
        "reformat the words",
        "change the casing of the text",
        "apply the formatting rule to the phrase",
    ),
    "arith": ("solve the arithmetic problem", "compute the value of the expression", "do the math"),
    "classify": ("classify the text", "pick the right label for the sentence", "categorize the input"),
    "listops": ("apply the list operation", "process the list of items", "transform the sequence"),
    "units": ("convert the measurement", "do the unit conversion", "express the quantity in another unit"),
    "dates": ("reformat the date", "convert the date notation", "write the date in another format"),
    "extract": (
        "extract a field from the record",
        "read the key-value record and return a value",
        "pull out one field",
    ),
}

# Tasks beyond the suite: realistic distractors, some deliberately close to suite tasks.
_BEYOND: tuple[str, ...] = (
    "summarize the paragraph in one sentence",
    "translate the sentence into French",
    "translate the sentence into German",
    "fix the grammar of the sentence",
    "write a haiku about the topic",
    "answer the trivia question",
    "explain what the code snippet does",
    "list three synonyms of the word",
    "detect the language of the text",
    "continue the story",
    "paraphrase the sentence",
    "extract all named entities",
    "give the antonym of the word",
    "find a word that rhymes",
    "write a title for the article",
    "answer yes or no",
    "count the vowels in the word",
    "spell the word backwards",
    "convert the number to Roman numerals",
    "write the number in words",
    "convert Celsius to Fahrenheit",
    "give the capital of the country",
    "solve the logic puzzle",
    "rate how toxic the comment is",
    "correct the spelling mistakes",
    "simplify the sentence for a child",
    "expand the abbreviation",
    "format the phone number",
    "normalize the postal address",
    "compute the average of the numbers",
    "find the longest word",
    "sort the words by length",
    "convert the time to 24-hour format",
    "give the day of the week for the date",
    "convert kilograms to pounds",
    "convert miles to kilometres",
    "write a polite email reply",
    "generate a SQL schema for the description",
    "turn the bullet points into a paragraph",
    "extract the email address from the text",
    "detect sarcasm in the tweet",
    "rate the essay from 1 to 5",
    "write the opposite statement",
    "find the main verb of the sentence",
    "tag each word with its part of speech",
    "compute the factorial of the number",
    "check whether the number is prime",
    "round the number to tens",
    "convert binary to decimal",
    "give the chemical symbol of the element",
    "name the author of the quote",
    "write a product description",
    "classify the question type",
    "split the sentence into words",
    "join the lines with commas",
    "remove the stop words",
    "convert the text to pig latin",
    "write a limerick about the word",
    "generate a password hint",
    "describe the image caption in detail",
)


def _frame(core: str, frame: str) -> str:
    cap = core[:1].upper() + core[1:]
    return frame.format(c=core, C=cap)


def _framed(core: str) -> list[str]:
    frames = _QUESTION_FRAMES if core.endswith("?") else FRAMES
    return [_frame(core, f) for f in frames]


def _take(rng: random.Random, options: list[str], n: int) -> list[str]:
    return rng.sample(options, min(n, len(options)))


def candidate_pool(
    seed: int = 0, per_task: int = 28, per_family: int = 30, per_beyond: int = 12
) -> list[str]:
    """All generated candidates, deduplicated, in a deterministic order (≈ 3,200 with the defaults).

    The suite's own instructions come first, verbatim; then, per task, `per_task` framed cores; per
    family, `per_family` framed generic cores; per beyond-suite task, `per_beyond` framings.
    """
    rng = random.Random(f"elastune-bank/candidates/{seed}")
    out: list[str] = []
    for fam in T.FAMILIES:
        out += T.family_instructions(fam)
        for spec in T.list_tasks([fam]):
            out += T.partition_instructions(spec)
    for spec in T.list_tasks():
        options = [p for core in task_cores(spec) for p in _framed(core)]
        out += _take(rng, options, per_task)
    for fam in T.FAMILIES:
        options = [p for core in _FAMILY_CORES[fam] for p in _framed(core)]
        out += _take(rng, options, per_family)
    for core in _BEYOND:
        out += _take(rng, _framed(core), per_beyond)
    return list(dict.fromkeys(out))


def default_candidates(n: int = DEFAULT_SIZE, seed: int = 0) -> list[str]:
    """`n` distinct candidates: the suite's instructions plus a seeded sample of the generated rest."""
    pool = candidate_pool(seed)
    if n > len(pool):
        raise ValueError(f"only {len(pool)} distinct candidates can be generated, {n} requested")
    verbatim = len(dict.fromkeys(_verbatim()))
    head, rest = pool[:verbatim], pool[verbatim:]
    if n <= verbatim:
        return head[:n]
    rng = random.Random(f"elastune-bank/sample/{seed}")
    keep = set(rng.sample(range(len(rest)), n - verbatim))
    return head + [p for i, p in enumerate(rest) if i in keep]


def _verbatim() -> Iterable[str]:
    for fam in T.FAMILIES:
        yield from T.family_instructions(fam)
        for spec in T.list_tasks([fam]):
            yield from T.partition_instructions(spec)
