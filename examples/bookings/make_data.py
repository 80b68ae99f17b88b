"""Writes train.jsonl and eval.jsonl beside this file: meeting requests written the way
people write them, each with the `book_meeting` call it asks for.

    python examples/bookings/make_data.py      # deterministic: the files shipped here

A row: {"prompt": "...", "answer": {"attendee", "date", "start", "duration_min"}}. Dates
are written in several styles (March 14, 14/03, 2027-03-14, the 14th of March), times as
3pm, 15:00 or "half past two", durations as "45 minutes", "an hour", "1.5 hours"; the answer
is always the normalised value (YYYY-MM-DD, 24-hour HH:MM, whole minutes).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = [
    "Dana Whitfield", "Omar Haddad", "Priya Natarajan", "Lukas Becker", "Mei Chen",
    "Sofia Alvarez", "Kwame Mensah", "Ingrid Larsen", "Tomás Ruiz", "Aiko Tanaka",
    "Felix Wagner", "Nadia Petrova", "Jonah Brooks", "Amara Okafor", "Hugo Laurent",
    "Leila Farah", "Marco Bianchi", "Grace O'Neill", "Ravi Kapoor", "Elena Sokolova",
]  # fmt: skip
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]  # fmt: skip
DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
DURATIONS = {15: ["15 minutes", "a quarter of an hour", "15 min"],
             30: ["30 minutes", "half an hour", "30 min"],
             45: ["45 minutes", "three quarters of an hour", "45 min"],
             60: ["an hour", "60 minutes", "1 hour"],
             90: ["an hour and a half", "90 minutes", "1.5 hours"],
             120: ["two hours", "2 hours", "120 minutes"]}  # fmt: skip
TEMPLATES = [
    "Please book a meeting with {who} on {date} at {time} for {dur}.",
    "Can you set up {dur} with {who}? {date}, starting {time}.",
    "Schedule a call with {who} for {dur} on {date}, {time} start.",
    "I need {dur} with {who} at {time} on {date}. Book it please.",
    "Put {who} in my calendar: {date} at {time}, {dur}.",
    "Hi! Could you arrange a meeting with {who}? It should last {dur} and start at {time} "
    "on {date}.",
]
WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven",
         8: "eight", 9: "nine", 10: "ten", 11: "eleven", 12: "twelve"}  # fmt: skip


def ordinal(day: int) -> str:
    suffix = "th" if 11 <= day % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day}{suffix}"


def write_date(rng: random.Random, year: int, month: int, day: int) -> str:
    return rng.choice([
        f"{MONTHS[month - 1]} {day}",
        f"{MONTHS[month - 1]} {ordinal(day)}, {year}",
        f"the {ordinal(day)} of {MONTHS[month - 1]}",
        f"{year}-{month:02d}-{day:02d}",
        f"{day:02d}/{month:02d}/{year}",
    ])  # fmt: skip


def write_time(rng: random.Random, hour: int, minute: int) -> str:
    twelve = hour % 12 or 12
    half = "am" if hour < 12 else "pm"
    styles = [f"{hour:02d}:{minute:02d}"]
    if minute == 0:
        styles += [f"{twelve}{half}", f"{twelve} {half.upper()}", f"{twelve} o'clock"
                   if 9 <= hour <= 12 else f"{twelve}{half}"]  # fmt: skip
    elif minute == 30:
        styles += [f"{twelve}:30{half}", f"half past {WORDS[twelve]}" if 9 <= hour <= 12
                   else f"{twelve}:30 {half}"]  # fmt: skip
    else:
        styles += [f"{twelve}:{minute:02d} {half}"]
    return rng.choice(styles)


def make_row(rng: random.Random, year: int = 2027) -> dict:
    month = rng.randint(1, 12)
    day = rng.randint(1, DAYS[month - 1])
    hour, minute = rng.randint(8, 17), rng.choice([0, 0, 15, 30, 30, 45])
    minutes = rng.choice(list(DURATIONS))
    who = rng.choice(NAMES)
    prompt = rng.choice(TEMPLATES).format(
        who=who,
        date=write_date(rng, year, month, day),
        time=write_time(rng, hour, minute),
        dur=rng.choice(DURATIONS[minutes]),
    )
    answer = {
        "attendee": who,
        "date": f"{year}-{month:02d}-{day:02d}",
        "duration_min": minutes,
        "start": f"{hour:02d}:{minute:02d}",
    }
    return {"prompt": prompt, "answer": answer}


def main() -> None:
    here = Path(__file__).parent
    rng = random.Random(2027)
    rows, seen = [], set()
    while len(rows) < 640:
        row = make_row(rng)
        if row["prompt"] not in seen:  # the held-out rows never repeat a train prompt
            seen.add(row["prompt"])
            rows.append(row)
    for name, part in (("train.jsonl", rows[:512]), ("eval.jsonl", rows[512:])):
        with (here / name).open("w") as f:
            for row in part:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
