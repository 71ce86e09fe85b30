"""The built-in prompt set `instructions`: MT-Bench-like requests written for this project.

MT-Bench's eight categories (writing, roleplay, reasoning, math, coding, extraction, STEM, humanities)
are each a few request templates crossed with subjects, so a draft trained on them sees the kinds of
answers a chat benchmark asks for without training on the benchmark's own questions.
"""

from __future__ import annotations

import random
from functools import lru_cache
from itertools import zip_longest

_TOPICS = ["remote work", "urban gardening", "electric cars", "a small bakery", "ocean pollution",
           "learning a second language", "public libraries", "space tourism", "a rainy weekend",
           "online privacy", "renewable energy", "a mountain village", "video games", "healthy sleep",
           "a first job interview", "recycling", "a local football club", "artificial intelligence",
           "street food", "a lost cat", "volunteering", "minimalism", "a science fair", "train travel"]

_PEOPLE = ["a medieval knight", "a ship's captain", "a detective in 1920s London", "a travel guide in Kyoto",
           "a personal fitness coach", "a patient math tutor", "a pirate", "a museum curator",
           "a startup founder pitching to investors", "a nervous first-time novelist", "a chef on a cooking show",
           "a sports commentator", "a wise old librarian", "an astronaut on the International Space Station"]

_CONCEPTS = ["photosynthesis", "supply and demand", "the water cycle", "compound interest", "natural selection",
             "the greenhouse effect", "inflation", "plate tectonics", "the immune system", "binary numbers",
             "Newton's laws of motion", "opportunity cost", "the placebo effect", "entropy", "vaccines",
             "black holes", "machine learning", "the scientific method", "electric circuits", "DNA replication"]

_HISTORY = ["the printing press", "the Industrial Revolution", "the Silk Road", "the Renaissance",
            "the French Revolution", "the invention of the telephone", "the Roman Empire", "the Cold War",
            "the abolition of slavery", "the moon landing", "ancient Egyptian pyramids", "the Olympic Games"]

_CODE_TASKS = ["reverses the words in a sentence", "checks whether a string is a palindrome",
               "returns the n-th Fibonacci number", "merges two sorted lists", "counts the vowels in a text",
               "finds the most frequent element of a list", "removes duplicates from a list while keeping order",
               "converts a Roman numeral to an integer", "computes the greatest common divisor of two numbers",
               "checks whether a number is prime", "flattens a nested list", "groups words that are anagrams",
               "returns the longest common prefix of a list of strings", "validates a simple email address",
               "implements binary search", "transposes a matrix"]

_LANGUAGES = ["Python", "JavaScript", "C++", "Java", "Go", "Rust"]

_RECORDS = [
    "Order 1042: 3 notebooks at $2.50 each, 1 backpack at $34.99, shipped to Lyon on March 3.",
    "Meeting notes: Anna will draft the budget by Friday; Ben reviews the venue contract; the launch moves to June 12.",
    "Product review: The blender is powerful and quiet, but the lid cracked after two months. Support replaced it quickly.",
    "Flight AF 274 departs Paris at 10:35 and lands in Tokyo at 06:20 the next day; the gate is K42.",
    "Recipe: mix 200 g flour, 2 eggs, 300 ml milk and a pinch of salt; rest 30 minutes; cook thin pancakes.",
    "Invoice 77-B: consulting, 12 hours at 90 euros; travel, 145 euros; due within 30 days.",
    "Weather report: Monday sunny and 24 C, Tuesday showers and 18 C, Wednesday windy and 20 C.",
    "Job ad: Junior data analyst, Berlin, hybrid, SQL and Python required, salary 48,000 to 55,000 euros.",
    "Email: Hi Sam, the printer on floor 3 is fixed. The new toner costs $89 and arrives Tuesday. - Priya",
    "Sports result: the Harbor Hawks beat the Valley Foxes 3-2 on Saturday; Lee scored twice in the last 10 minutes.",
    "Lease: apartment 4B, 2 bedrooms, 1,450 dollars a month, deposit of one month, starting September 1.",
    "Lab note: sample A boiled at 78 C, sample B at 100 C; sample C froze at -4 C after 35 minutes.",
    "Train notice: the 8:12 service to Leeds is cancelled; passengers may take the 8:40, which calls at York.",
    "Survey: 120 people asked; 54 prefer tea, 48 coffee, 18 neither. Most tea drinkers were over 40.",
]

_TEMPLATES = {
    "writing": [
        "Write a short blog post about {topic}.",
        "Compose a persuasive email to your neighbours about {topic}.",
        "Write a poem of four stanzas about {topic}.",
        "Draft a product description for a new service related to {topic}.",
        "Write a short story that begins on a train and involves {topic}.",
        "Write a speech for a school assembly about {topic}.",
        "Give five catchy headlines for an article on {topic}.",
    ],
    "roleplay": [
        "Pretend you are {person}. Introduce yourself and describe a typical day.",
        "Act as {person} and give advice to someone worried about {topic}.",
        "You are {person}. Explain to a child why {topic} matters.",
        "Imagine you are {person}. Write a diary entry about your most surprising day.",
    ],
    "reasoning": [
        "If all bloops are razzies and some razzies are lazzies, are some bloops necessarily lazzies? Explain.",
        "A farmer has {a} sheep and all but {b} run away. How many are left? Explain your reasoning.",
        "Five friends stand in a line. {name} is not first, and Ben stands right after Ana. "
        "List a possible order and justify it.",
        "Which weighs more, {a} kilograms of feathers or {b} kilograms of steel? Explain step by step.",
        "A clock shows 3:15. What is the angle between the hour and minute hands? Think step by step.",
        "What are the pros and cons of {topic}? Weigh them and reach a conclusion.",
    ],
    "math": [
        "Solve for x: {a}x + {b} = {c}. Show your steps.",
        "A shop sells pens at ${a} each and notebooks at ${b} each. How much do {c} pens and {a} notebooks cost?",
        "What is the sum of the integers from 1 to {c}? Explain the method.",
        "A rectangle has a perimeter of {p} cm and a width of {a} cm. What is its area?",
        "If a train travels {c} km in {a} hours, what is its average speed? How far does it go in {b} hours?",
        "Find the probability of rolling a sum of {s} with two fair dice.",
        "Compute {a}% of {c} and explain how percentages work.",
    ],
    "coding": [
        "Write a {lang} function that {task}.",
        "Explain, with an example in {lang}, how to write a function that {task}.",
        "Here is a task: write code that {task}. Use {lang} and add comments.",
        "What is the time complexity of a function that {task}? Give an implementation in {lang}.",
    ],
    "extraction": [
        "Extract every number and what it refers to from this text: {record}",
        "Summarize the following in one sentence, then list the key facts as JSON: {record}",
        "From this text, identify any dates, places and amounts of money: {record}",
        "Turn this into a table with one row per fact: {record}",
        "Who or what is mentioned in the following, and what happens? {record}",
    ],
    "stem": [
        "Explain {concept} in simple terms.",
        "What is {concept}? Give a real-world example.",
        "Describe {concept} to a high-school student, including one common misconception.",
        "How does {concept} relate to everyday life? Give three examples.",
    ],
    "humanities": [
        "Discuss the impact of {event} on society.",
        "What were the main causes and consequences of {event}?",
        "Compare {event} with {other} in terms of their influence on culture.",
        "Write a short essay on what we can learn today from {event}.",
    ],
}

_NAMES = ["Ana", "Carl", "Dana", "Eli"]


def _fill(template: str, rng: random.Random) -> str:
    a, b = rng.randint(2, 19), rng.randint(2, 19)
    return template.format(
        topic=rng.choice(_TOPICS), person=rng.choice(_PEOPLE), concept=rng.choice(_CONCEPTS),
        event=rng.choice(_HISTORY), other=rng.choice(_HISTORY), task=rng.choice(_CODE_TASKS),
        lang=rng.choice(_LANGUAGES), record=rng.choice(_RECORDS), name=rng.choice(_NAMES),
        a=a, b=b, c=rng.randint(20, 120), p=2 * (a + b + 10), s=rng.randint(2, 12))


@lru_cache(maxsize=1)
def _all(count: int) -> tuple[str, ...]:
    rng = random.Random(0)
    per_category = []
    for templates in _TEMPLATES.values():
        seen: dict[str, None] = {}
        for _ in range(4 * count):                # tries; a category with fewer combinations ends early
            if len(seen) >= count:
                break
            seen.setdefault(_fill(rng.choice(templates), rng), None)
        per_category.append(list(seen))
    # Categories in turn, so that any prefix of the list is balanced while each lasts.
    mixed = [p for group in zip_longest(*per_category) for p in group if p is not None]
    return tuple(mixed[:count])


def instructions(count: int = 2000) -> list[str]:
    """Up to `count` distinct instructions, the eight categories in turn, the same list on every call."""
    return list(_all(count))
