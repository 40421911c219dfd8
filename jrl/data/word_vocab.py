"""The words and random draws that the word-problem templates are written with
(`jrl/data/word_templates.py`): names with their pronouns, things to count,
buy and share, and `Draw`, the thin layer over a NumPy generator that every
template draws its numbers and words from.
"""

DIFFICULTIES = (1, 2, 3)
EVAL_BUCKETS = 5  # one question hash in EVAL_BUCKETS belongs to the held-out split

NAMES = (
  ('Ava', 'she', 'her'),
  ('Ben', 'he', 'his'),
  ('Carlos', 'he', 'his'),
  ('Dana', 'she', 'her'),
  ('Eli', 'he', 'his'),
  ('Fatima', 'she', 'her'),
  ('Grace', 'she', 'her'),
  ('Hiro', 'he', 'his'),
  ('Isla', 'she', 'her'),
  ('Jamal', 'he', 'his'),
  ('Kira', 'she', 'her'),
  ('Liam', 'he', 'his'),
  ('Maya', 'she', 'her'),
  ('Noah', 'he', 'his'),
  ('Olga', 'she', 'her'),
  ('Priya', 'she', 'her'),
  ('Ravi', 'he', 'his'),
  ('Sofia', 'she', 'her'),
  ('Tom', 'he', 'his'),
  ('Uma', 'she', 'her'),
  ('Victor', 'he', 'his'),
  ('Wen', 'she', 'her'),
  ('Yusuf', 'he', 'his'),
  ('Zoe', 'she', 'her'),
)
COLLECTIBLES = ('marbles', 'stickers', 'shells', 'cards', 'beads', 'stamps', 'crayons', 'coins')
SHOP_ITEMS = (
  'notebooks',
  'pens',
  'apples',
  'erasers',
  'rulers',
  'cupcakes',
  'toy cars',
  'comic books',
  'bottles of juice',
  'packs of gum',
)
FRUIT = ('apples', 'pears', 'plums', 'peaches', 'oranges', 'lemons', 'strawberries')
SINGLE_THINGS = ('game', 'book', 'hat', 'kite', 'puzzle', 'ball', 'scarf', 'lunch box')
MACHINES = (  # (subject, verb (3rd person), verb, things, unit)
  ('printer', 'prints', 'print', 'pages', 'minute'),
  ('baker', 'bakes', 'bake', 'loaves of bread', 'hour'),
  ('pump', 'fills', 'fill', 'buckets', 'minute'),
  ('farmer', 'plants', 'plant', 'trees', 'day'),
  ('factory', 'builds', 'build', 'bikes', 'hour'),
  ('robot', 'sorts', 'sort', 'boxes', 'minute'),
)
GROUPS = (  # (things, place, what one third do, what the rest do)
  ('students', 'a class', 'walk to school', 'ride the bus'),
  ('birds', 'a tree', 'are sparrows', 'are crows'),
  ('books', 'a shelf', 'are new', 'are old'),
  ('cars', 'a parking lot', 'are red', 'are blue'),
  ('players', 'a club', 'play chess', 'play checkers'),
  ('children', 'a park', 'are on the swings', 'are on the slide'),
  ('fish', 'a pond', 'are gold', 'are gray'),
  ('tickets', 'a box', 'are sold', 'are unsold'),
)
PACKED_GOODS = (  # (place, verb, goods, containers)
  ('A farm', 'collects', 'eggs', 'cartons'),
  ('A bakery', 'bakes', 'muffins', 'boxes'),
  ('An orchard', 'picks', 'apples', 'crates'),
  ('A garden', 'grows', 'tomatoes', 'baskets'),
)


class Draw:
  """Random draws for one problem (a thin layer over a NumPy generator)."""

  def __init__(self, rng):
    self.rng = rng

  def int(self, lo, hi):
    """An int in [lo, hi]."""
    return int(self.rng.integers(lo, hi + 1))

  def pick(self, options):
    return options[int(self.rng.integers(len(options)))]

  def people(self, k):
    """`k` distinct (name, subject pronoun, possessive) triples."""
    return [NAMES[int(i)] for i in self.rng.choice(len(NAMES), size=k, replace=False)]

  def distinct(self, options, k):
    return [options[int(i)] for i in self.rng.choice(len(options), size=k, replace=False)]


def eq(expr, value):
  """'expr = value': the form every step of a worked solution takes."""
  return f'{expr} = {value}'
