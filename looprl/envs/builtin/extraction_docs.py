"""Synthetic documents for the `extraction` environment: invoices, contact cards, event notices.

Every document is drawn from one seed: values from small word lists, one of three layouts
(label: value lines, prose, a small table), varied ways of writing dates ("March 5, 2026",
"Thu, Mar 5, 2026", "15/03/2026", ISO), times ("7:30 PM", "19:30", "7.30PM"), amounts
("$1,242.00", "1,242.00 EUR") and phone numbers, and distractors beside each answer: a
subtotal, tax and line items next to the total, an issue date next to the due date, a
customer next to the vendor, a cc address, a switchboard number and a former employer next
to the contact's own, a previous edition's date, city and start time, and the time the doors
open. Filler sentences bring each document to 60-90 words. The record holds the normalised
answers: YYYY-MM-DD dates, 24-hour HH:MM times, the total as a plain number.

Numeric slash dates are written DD/MM/YYYY only when the day is above 12, so no date can be
read two ways.
"""

from __future__ import annotations

import random
from datetime import date, timedelta
from typing import Any

KINDS = ("invoice", "contact", "event")
LAYOUTS = ("lines", "prose", "table")
MIN_WORDS, MAX_WORDS = 60, 120  # every document's length in words (filler aims at 60-90)

# Word lists, kept dense: one word per line would bury the code below them.
# fmt: off
_FIRST = ["Ana", "Bruno", "Chen", "Dana", "Elif", "Farah", "Goran", "Hana", "Ivan", "Jonas",
          "Keiko", "Luis", "Maya", "Nadia", "Omar", "Priya", "Rosa", "Samir", "Tomas", "Uma",
          "Vera", "Wei", "Yusuf", "Zoe"]
_LAST = ["Okafor", "Lindqvist", "Moreau", "Tanaka", "Silva", "Novak", "Haddad", "Kowalski",
         "Brennan", "Ferreira", "Ito", "Mensah", "Petrov", "Quinn", "Rossi", "Schmidt", "Varga",
         "Walsh", "Yilmaz", "Zhou"]
_BRANDS = ["Northwind", "Bluebird", "Cedar", "Harbor", "Ironleaf", "Juniper", "Kestrel", "Lumen",
           "Maple", "Nimbus", "Orchid", "Pinecrest", "Quartz", "Redwood", "Silverline",
           "Tidewater"]
_TRADES = ["Traders", "Labs", "Logistics", "Media", "Systems", "Foods", "Analytics", "Design",
           "Robotics", "Supply"]
_CITIES = ["Lisbon", "Oslo", "Denver", "Kyoto", "Porto", "Austin", "Leeds", "Tallinn", "Seville",
           "Montreal", "Bergen", "Krakow", "Adelaide", "Nairobi", "Utrecht", "Valencia"]
_TOPICS = ["Data Engineering", "Urban Gardening", "Open Source", "Jazz", "Robotics",
           "Product Design", "Climate Tech", "Board Games", "Street Food", "Photography"]
_FORMS = ["Meetup", "Summit", "Night", "Workshop", "Festival", "Forum", "Conference"]
_ROLES = ["Senior Analyst", "Head of Sales", "Product Manager", "Operations Lead",
          "Account Director", "Research Engineer", "Office Manager"]
_ITEMS = ["Consulting hours", "Software licence", "Freight", "Design work", "Maintenance plan",
          "Training session", "Hosting"]
_VENUES = ["the Old Library", "Harbour Hall", "the Civic Centre", "Riverside Pavilion",
           "the Glasshouse", "Dock 7"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December"]
_WEEKDAYS = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]
# fmt: on
_CURRENCIES = [("$", ""), ("USD ", ""), ("", " EUR"), ("€", ""), ("£", ""), ("", " GBP")]
_FILLER = {
    "invoice": [
        "Please quote the invoice number with your payment.",
        "Bank transfer details are printed on the second page.",
        "Late payments may incur interest of 1.5% per month.",
        "Thank you for your business, we look forward to working with you again.",
        "Questions about this invoice? Reply to this message and our accounts team will help.",
        "Goods remain our property until paid in full.",
        "This invoice was generated electronically and is valid without a signature.",
        "Our payment terms changed this year; see the enclosed letter.",
        "Keep this document for your tax records.",
        "Partial deliveries are invoiced separately.",
    ],
    "contact": [
        "I usually answer emails within a day.",
        "Happy to set up a call whenever suits you.",
        "Please note our office is closed on public holidays.",
        "Feel free to pass my details on to your colleagues.",
        "I am in the office Monday to Thursday and work remotely on Fridays.",
        "Looking forward to staying in touch.",
        "My pronouns and time zone are listed on my profile page.",
        "If I do not reply, I may be travelling; try again next week.",
        "Our team also covers partner support across the region.",
        "Please do not send large attachments; use the shared folder instead.",
    ],
    "event": [
        "Tickets are free but places are limited, so please register early.",
        "Light refreshments will be served during the break.",
        "The venue is step-free and a short walk from the central station.",
        "Talks are in English and will be recorded for those who cannot attend.",
        "Bring a friend: everyone is welcome, whatever their level of experience.",
        "Follow the organisers for updates on speakers and the full programme.",
        "Volunteers are still needed for the welcome desk.",
        "Please let us know about any dietary requirements when you register.",
        "Parking is limited, so public transport is recommended.",
        "The evening ends with an informal get-together nearby.",
    ],
}


def _date_text(day: date, rng: random.Random) -> str:
    month = _MONTHS[day.month - 1]
    styles = [
        day.isoformat(),
        f"{month} {day.day}, {day.year}",
        f"{day.day} {month} {day.year}",
        f"{_WEEKDAYS[day.weekday()]}, {month[:3]} {day.day}, {day.year}",
    ]
    if day.day > 12:  # DD/MM/YYYY only where it cannot be read as MM/DD
        styles.append(f"{day.day:02d}/{day.month:02d}/{day.year}")
    return rng.choice(styles)


def _time_text(minutes: int, rng: random.Random) -> str:
    hour, minute = divmod(minutes, 60)
    h12, half = (hour - 1) % 12 + 1, "AM" if hour < 12 else "PM"
    styles = [f"{hour:02d}:{minute:02d}", f"{h12}:{minute:02d} {half}", f"{h12}.{minute:02d}{half}"]
    return rng.choice(styles + ([f"{h12} {half}"] if minute == 0 else []))


def _phone(rng: random.Random, country: str, area: int) -> tuple[str, str]:
    """(normalised number, the number as printed)."""
    mid, end = rng.randint(100, 999), rng.randint(1000, 9999)
    printed = rng.choice(["+{} {} {} {}", "+{} ({}) {} {}", "+{}-{}-{}-{}", "+{}.{}.{}.{}"])
    return f"+{country} {area} {mid} {end}", printed.format(country, area, mid, end)


def _company(rng: random.Random, avoid: str = "") -> str:
    while True:
        name = f"{rng.choice(_BRANDS)} {rng.choice(_TRADES)}"
        if name.split()[0] not in avoid:  # a distractor company shares no word with the answer
            return name


def _other(rng: random.Random, pool: list[Any], avoid: Any) -> Any:
    return rng.choice([x for x in pool if x != avoid])


def _invoice(rng: random.Random, layout: str) -> tuple[list[str], dict[str, Any]]:
    vendor = _company(rng)
    customer = _company(rng, avoid=vendor)
    number = rng.choice(
        [
            f"INV-{rng.randint(10000, 99999)}",
            f"{vendor[:2].upper()}-{rng.randint(2024, 2026)}-{rng.randint(1, 9999):04d}",
            str(rng.randint(100000, 999999)),
        ]
    )
    po = f"PO-{rng.randint(1000, 9999)}"
    issued = date(rng.randint(2025, 2027), rng.randint(1, 12), rng.randint(1, 28))
    due = issued + timedelta(days=rng.choice([14, 21, 30, 45]))
    items_cents = [rng.randint(50_00, 4_000_00) for _ in range(2)]
    rate = rng.choice([5, 8, 10, 20])
    subtotal = sum(items_cents)
    tax = round(subtotal * rate / 100)
    pre, post = rng.choice(_CURRENCIES)
    sub, vat, total = (f"{pre}{c / 100:,.2f}{post}" for c in (subtotal, tax, subtotal + tax))
    item_a, item_b = (f"{pre}{c / 100:,.2f}{post}" for c in items_cents)
    issued_text, due_text = _date_text(issued, rng), _date_text(due, rng)
    names = rng.sample(_ITEMS, 2)
    lines = {
        "lines": [
            "INVOICE",
            f"From: {vendor}",
            f"Bill to: {customer}",
            f"Invoice no.: {number}",
            f"PO number: {po}",
            f"Issue date: {issued_text}",
            f"Subtotal: {sub}",
            f"Tax ({rate}%): {vat}",
            f"Total due: {total}",
            f"Payment due: {due_text}",
        ],
        "prose": [
            f"Hello {customer} team, please find attached invoice {number} from {vendor},",
            f"issued on {issued_text} against purchase order {po}. The subtotal is {sub};",
            f"with {rate}% tax ({vat}) the total amount due is {total}, payable by {due_text}.",
        ],
        "table": [
            f"{vendor} - Invoice {number}",
            f"Date: {issued_text} | Customer: {customer} ({po})",
            "| Description | Amount |",
            "|---|---|",
            f"| {names[0]} | {item_a} |",
            f"| {names[1]} | {item_b} |",
            f"| Subtotal | {sub} |",
            f"| Tax {rate}% | {vat} |",
            f"| Total | {total} |",
            f"Due date: {due_text}",
        ],
    }[layout]
    total_value = (subtotal + tax) / 100
    record = {"invoice_number": number, "vendor": vendor, "total": total_value}
    return lines, {**record, "due_date": due.isoformat()}


def _contact(rng: random.Random, layout: str) -> tuple[list[str], dict[str, Any]]:
    first, last = rng.choice(_FIRST), rng.choice(_LAST)
    name, role = f"{first} {last}", rng.choice(_ROLES)
    company = _company(rng)
    previous = _company(rng, avoid=company)
    domain = company.replace(" ", "").lower() + rng.choice([".com", ".io", ".co.uk", ".de"])
    local = rng.choice([f"{first}.{last}", f"{first[0]}{last}", first, f"{first}{last[0]}"])
    email = f"{local.lower()}@{domain}"
    helper = _other(rng, _FIRST, first)
    cc = rng.choice([f"{helper.lower()}@{domain}", f"office@{domain}", f"bookings@{domain}"])
    country, area = rng.choice(["1", "44", "49", "31", "61"]), rng.randint(200, 999)
    phone, phone_text = _phone(rng, country, area)
    office = _phone(rng, country, area)[1]  # same country and area code: a close distractor
    lines = {
        "lines": [
            name,
            f"{role}, {company}",
            f"Email: {email}",
            f"Direct: {phone_text}",
            f"Switchboard: {office}",
            f"Cc for scheduling: {cc}",
            f"Previously: {previous}",
        ],
        "prose": [
            f"Great to meet you last week! As promised, here are my details. I am {name},",
            f"{role} at {company} (I moved over from {previous} last spring). Email me at",
            f"{email} and please cc {cc} on anything about scheduling. My direct line is",
            f"{phone_text}; the front desk is on {office}.",
        ],
        "table": [
            f"| Contact | {name} |",
            "|---|---|",
            f"| Role | {role} |",
            f"| Company | {company} |",
            f"| Email | {email} |",
            f"| Mobile | {phone_text} |",
            f"| Office (main line) | {office} |",
            f"| Former employer | {previous} |",
            f"| CC for bookings | {cc} |",
        ],
    }[layout]
    return lines, {"name": name, "email": email, "phone": phone, "company": company}


def _event(rng: random.Random, layout: str) -> tuple[list[str], dict[str, Any]]:
    title = f"{rng.choice(_TOPICS)} {rng.choice(_FORMS)}"
    city = rng.choice(_CITIES)
    past_city = _other(rng, _CITIES, city)
    day = date(rng.randint(2025, 2027), rng.randint(1, 12), rng.randint(1, 28))
    past_day = day.replace(year=day.year - 1, day=_other(rng, list(range(1, 29)), day.day))
    start = rng.randint(9 * 4, 20 * 4) * 15  # minutes after midnight, 09:00-20:00
    doors = start - rng.choice([30, 45, 60])
    venue = rng.choice(_VENUES)
    when, past_when = _date_text(day, rng), _date_text(past_day, rng)
    deadline = _date_text(day - timedelta(days=rng.choice([5, 7, 10, 14])), rng)
    starts, opens = _time_text(start, rng), _time_text(doors, rng)
    past_starts = _time_text(rng.randint(9 * 4, 20 * 4) * 15, rng)
    lines = {
        "lines": [
            title.upper(),
            f"When: {when}",
            f"Doors open: {opens}",
            f"Programme starts: {starts}",
            f"Where: {venue}, {city}",
            f"Register by: {deadline}",
            f"Last edition: {past_when} in {past_city}",
        ],
        "prose": [
            f"After a sold-out edition in {past_city} on {past_when}, the {title} comes to",
            f"{city} on {when}! Doors at {venue} open at {opens} and the programme starts at",
            f"{starts}. Registration closes on {deadline}.",
        ],
        "table": [
            f"{title} - editions",
            "| Edition | Date | City | Starts |",
            "|---|---|---|---|",
            f"| previous | {past_when} | {past_city} | {past_starts} |",
            f"| upcoming | {when} | {city} | {starts} |",
            f"Upcoming: venue {venue}, doors open {opens}, register by {deadline}.",
        ],
    }[layout]
    start_time = f"{start // 60:02d}:{start % 60:02d}"
    return lines, {"title": title, "date": day.isoformat(), "city": city, "start_time": start_time}


_MAKERS = {"invoice": _invoice, "contact": _contact, "event": _event}


def make_document(kind: str, seed: int) -> dict[str, Any]:
    """Task data for one document: kind, layout, document text and ground-truth record."""
    rng = random.Random(seed)
    layout = rng.choice(LAYOUTS)
    lines, record = _MAKERS[kind](rng, layout)
    text = ("\n" if layout != "prose" else " ").join(lines)
    target = rng.randint(MIN_WORDS, 90)
    fillers = rng.sample(_FILLER[kind], len(_FILLER[kind]))
    while len(text.split()) < target and fillers:
        text += ("\n" if layout != "prose" else " ") + fillers.pop()
    return {"kind": kind, "layout": layout, "document": text, "record": record}
