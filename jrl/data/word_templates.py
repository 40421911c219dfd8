"""The templates of `jrl.data.word_problems`, by number of steps.

A template is a function `Draw -> (params, question, steps, answer)`
registered with its difficulty (the number of arithmetic steps, one line of
the worked solution each) and topic. Every quotient is drawn first and
multiplied out, so divisions are exact by construction; answers are
non-negative integers.
"""

from collections.abc import Callable
from typing import NamedTuple

from jrl.data.word_vocab import (
  COLLECTIBLES,
  FRUIT,
  GROUPS,
  MACHINES,
  PACKED_GOODS,
  SHOP_ITEMS,
  SINGLE_THINGS,
  eq,
)


class Template(NamedTuple):
  name: str
  difficulty: int
  topic: str  # people, items, prices, halves, thirds, rates, ages, sharing
  make: Callable  # Draw -> (params, question, steps, answer)


TEMPLATES = []


def _template(difficulty, topic):
  def register(make):
    TEMPLATES.append(Template(make.__name__.lstrip('_'), difficulty, topic, make))
    return make

  return register


# One step ------------------------------------------------------------------------


@_template(1, 'prices')
def _buy_items(d):
  (a, _, _), item = d.people(1)[0], d.pick(SHOP_ITEMS)
  n, p = d.int(2, 9), d.int(2, 12)
  q = f'{a} buys {n} {item} that cost ${p} each. How many dollars does {a} spend?'
  total = n * p
  return dict(n=n, p=p), q, (f'{a} spends {eq(f"{n} * {p}", total)} dollars.',), total


@_template(1, 'items')
def _give_away(d):
  (a, she, _), (b, _, _) = d.people(2)
  things = d.pick(COLLECTIBLES)
  have = d.int(12, 60)
  give = d.int(2, have - 2)
  q = (
    f'{a} has {have} {things}. {she.capitalize()} gives {give} of them to {b}. '
    f'How many {things} does {a} have left?'
  )
  left = have - give
  return (
    dict(have=have, give=give),
    q,
    (f'{a} has {eq(f"{have} - {give}", left)} {things} left.',),
    left,
  )


@_template(1, 'sharing')
def _share_equally(d):
  (a, _, _), things = d.people(1)[0], d.pick(COLLECTIBLES + ('cookies', 'grapes'))
  k, each = d.int(2, 8), d.int(2, 12)
  total = k * each
  q = (
    f'{a} shares {total} {things} equally among {k} friends. '
    f'How many {things} does each friend get?'
  )
  return (
    dict(total=total, k=k),
    q,
    (f'Each friend gets {eq(f"{total} / {k}", each)} {things}.',),
    each,
  )


@_template(1, 'halves')
def _half_of(d):
  things = d.pick(('marbles', 'beads', 'balloons', 'crayons', 'flowers'))
  box, color = d.pick(('box', 'jar', 'bag')), d.pick(('red', 'blue', 'green', 'yellow'))
  half = d.int(3, 40)
  total = 2 * half
  q = (
    f'A {box} holds {total} {things}. Half of them are {color}. '
    f'How many {color} {things} are in the {box}?'
  )
  return dict(total=total), q, (f'There are {eq(f"{total} / 2", half)} {color} {things}.',), half


@_template(1, 'rates')
def _rate_time(d):
  subject, verbs, verb, things, unit = d.pick(MACHINES)
  rate, time = d.int(2, 15), d.int(2, 9)
  q = (
    f'A {subject} {verbs} {rate} {things} every {unit}. '
    f'How many {things} does the {subject} {verb} in {time} {unit}s?'
  )
  total = rate * time
  steps = (f'The {subject} {verbs} {eq(f"{rate} * {time}", total)} {things}.',)
  return dict(rate=rate, time=time), q, steps, total


@_template(1, 'ages')
def _age_later(d):
  a, _, _ = d.people(1)[0]
  age, years = d.int(5, 40), d.int(2, 20)
  q = f'{a} is {age} years old. How old will {a} be in {years} years?'
  later = age + years
  return (
    dict(age=age, years=years),
    q,
    (f'{a} will be {eq(f"{age} + {years}", later)} years old.',),
    later,
  )


@_template(1, 'items')
def _find_more(d):
  (a, she, _), things = d.people(1)[0], d.pick(COLLECTIBLES)
  have, more = d.int(2, 20), d.int(2, 20)
  q = (
    f'{a} has {have} {things}. {she.capitalize()} finds {more} more. '
    f'How many {things} does {a} have now?'
  )
  total = have + more
  return (
    dict(have=have, more=more),
    q,
    (f'{a} has {eq(f"{have} + {more}", total)} {things}.',),
    total,
  )


@_template(1, 'items')
def _eat_some(d):
  (a, she, _), fruit = d.people(1)[0], d.pick(FRUIT)
  have = d.int(5, 20)
  eat = d.int(1, have - 1)
  q = f'{a} has {have} {fruit}. {she.capitalize()} eats {eat} of them. How many {fruit} are left?'
  left = have - eat
  steps = (f'There are {eq(f"{have} - {eat}", left)} {fruit} left.',)
  return dict(have=have, eat=eat), q, steps, left


@_template(1, 'people')
def _twice_as_many(d):
  (a, _, _), (b, _, _) = d.people(2)
  things = d.pick(COLLECTIBLES)
  have = d.int(2, 25)
  q = (
    f'{a} has {have} {things}. {b} has twice as many {things} as {a}. '
    f'How many {things} does {b} have?'
  )
  total = 2 * have
  return dict(have=have), q, (f'{b} has {eq(f"2 * {have}", total)} {things}.',), total


# Two steps -----------------------------------------------------------------------


@_template(2, 'prices')
def _buy_change(d):
  (a, _, _), item = d.people(1)[0], d.pick(SHOP_ITEMS)
  n, p = d.int(2, 6), d.int(2, 9)
  cost = n * p
  bill = d.pick([b for b in (20, 50, 100) if b > cost])
  q = (
    f'{a} buys {n} {item} at ${p} each and pays with a ${bill} bill. '
    f'How much change, in dollars, does {a} get?'
  )
  change = bill - cost
  steps = (
    f'The {item} cost {eq(f"{n} * {p}", cost)} dollars.',
    f'{a} gets {eq(f"{bill} - {cost}", change)} dollars in change.',
  )
  return dict(n=n, p=p, bill=bill), q, steps, change


@_template(2, 'ages')
def _age_sum(d):
  (a, _, _), (b, _, _) = d.people(2)
  age, older = d.int(4, 30), d.int(2, 30)
  q = f'{a} is {age} years old. {b} is {older} years older than {a}. What is the sum of their ages?'
  b_age = age + older
  total = age + b_age
  steps = (
    f'{b} is {eq(f"{age} + {older}", b_age)} years old.',
    f'Together they are {eq(f"{age} + {b_age}", total)} years old.',
  )
  return dict(age=age, older=older), q, steps, total


@_template(2, 'thirds')
def _third_rest(d):
  things, place, first, rest = d.pick(GROUPS)
  third = d.int(2, 30)
  total = 3 * third
  q = (
    f'There are {total} {things} in {place}. One third of them {first} and the rest {rest}. '
    f'How many of the {things} {rest}?'
  )
  left = total - third
  steps = (
    f'{eq(f"{total} / 3", third)} {things} {first}.',
    f'So {eq(f"{total} - {third}", left)} {things} {rest}.',
  )
  return dict(total=total), q, steps, left


@_template(2, 'sharing')
def _pack_bags(d):
  (a, she, _), food = d.people(1)[0], d.pick(('cookies', 'muffins', 'rolls', 'brownies'))
  batches, per_batch = d.int(2, 6), d.int(4, 12)
  made = batches * per_batch
  bag = d.pick([b for b in range(2, 13) if made % b == 0 and b < made])
  q = (
    f'{a} bakes {batches} batches of {per_batch} {food} and packs them into bags of {bag}. '
    f'How many bags does {she} fill?'
  )
  bags = made // bag
  steps = (
    f'{a} bakes {eq(f"{batches} * {per_batch}", made)} {food}.',
    f'That fills {eq(f"{made} / {bag}", bags)} bags.',
  )
  return dict(batches=batches, per_batch=per_batch, bag=bag), q, steps, bags


@_template(2, 'rates')
def _two_readers(d):
  (a, _, _), (b, _, _) = d.people(2)
  r1, r2, hours = d.int(2, 12), d.int(2, 12), d.int(2, 8)
  q = (
    f'{a} reads {r1} pages an hour and {b} reads {r2} pages an hour. '
    f'If they both read for {hours} hours, how many pages do they read in all?'
  )
  both = r1 + r2
  total = both * hours
  steps = (
    f'Together they read {eq(f"{r1} + {r2}", both)} pages an hour.',
    f'In {hours} hours they read {eq(f"{both} * {hours}", total)} pages.',
  )
  return dict(r1=r1, r2=r2, hours=hours), q, steps, total


@_template(2, 'sharing')
def _collect_share(d):
  (a, she, _), fruit = d.people(1)[0], d.pick(FRUIT)
  baskets, each = d.int(2, 6), d.int(3, 12)
  total = baskets * each
  morning = d.int(1, total - 1)
  afternoon = total - morning
  q = (
    f'{a} picks {morning} {fruit} in the morning and {afternoon} {fruit} in the afternoon. '
    f'{she.capitalize()} puts them equally into {baskets} baskets. '
    f'How many {fruit} go in each basket?'
  )
  steps = (
    f'{a} picks {eq(f"{morning} + {afternoon}", total)} {fruit}.',
    f'Each basket gets {eq(f"{total} / {baskets}", each)} {fruit}.',
  )
  return dict(morning=morning, afternoon=afternoon, baskets=baskets), q, steps, each


@_template(2, 'prices')
def _weekly_savings(d):
  (a, she, _), thing = d.people(1)[0], d.pick(SINGLE_THINGS)
  per_week, weeks = d.int(2, 15), d.int(2, 10)
  saved = per_week * weeks
  spent = d.int(1, saved - 1)
  q = (
    f'{a} saves ${per_week} every week. After {weeks} weeks, {she} spends ${spent} on a {thing}. '
    f'How many dollars does {a} have left?'
  )
  left = saved - spent
  steps = (
    f'{a} saves {eq(f"{per_week} * {weeks}", saved)} dollars.',
    f'{a} has {eq(f"{saved} - {spent}", left)} dollars left.',
  )
  return dict(per_week=per_week, weeks=weeks, spent=spent), q, steps, left


# Three steps ---------------------------------------------------------------------


@_template(3, 'prices')
def _two_purchases(d):
  (a, _, _), (item1, item2) = d.people(1)[0], d.distinct(SHOP_ITEMS, 2)
  n1, p1, n2, p2 = d.int(2, 6), d.int(1, 9), d.int(2, 6), d.int(1, 9)
  q = (
    f'{a} buys {n1} {item1} for ${p1} each and {n2} {item2} for ${p2} each. '
    f'How many dollars does {a} spend in all?'
  )
  c1, c2 = n1 * p1, n2 * p2
  total = c1 + c2
  steps = (
    f'The {item1} cost {eq(f"{n1} * {p1}", c1)} dollars.',
    f'The {item2} cost {eq(f"{n2} * {p2}", c2)} dollars.',
    f'In all {a} spends {eq(f"{c1} + {c2}", total)} dollars.',
  )
  return dict(n1=n1, p1=p1, n2=n2, p2=p2), q, steps, total


@_template(3, 'prices')
def _budget_left(d):
  (a, she, _), item, thing = d.people(1)[0], d.pick(SHOP_ITEMS), d.pick(SINGLE_THINGS)
  n, p, price = d.int(2, 6), d.int(2, 9), d.int(3, 20)
  cost = n * p
  spent = cost + price
  money = spent + d.int(1, 30)
  q = (
    f'{a} has ${money}. {she.capitalize()} buys {n} {item} at ${p} each and a {thing} '
    f'for ${price}. How many dollars does {a} have left?'
  )
  left = money - spent
  steps = (
    f'The {item} cost {eq(f"{n} * {p}", cost)} dollars.',
    f'{a} spends {eq(f"{cost} + {price}", spent)} dollars.',
    f'{a} has {eq(f"{money} - {spent}", left)} dollars left.',
  )
  return dict(money=money, n=n, p=p, price=price), q, steps, left


@_template(3, 'halves')
def _half_then_give(d):
  (a, she, _), (b, _, _), (c, _, _) = d.people(3)
  things = d.pick(COLLECTIBLES)
  half = d.int(5, 40)
  total = 2 * half
  give, buy = d.int(1, half - 1), d.int(1, 20)
  q = (
    f'{a} has {total} {things}. {she.capitalize()} gives half of them to {b} and then gives '
    f'{give} to {c}. After that, {she} buys {buy} more. How many {things} does {a} have now?'
  )
  after_give = half - give
  now = after_give + buy
  steps = (
    f'After giving half away, {a} has {eq(f"{total} / 2", half)} {things}.',
    f'After giving some to {c}, {she} has {eq(f"{half} - {give}", after_give)} {things}.',
    f'Now {she} has {eq(f"{after_give} + {buy}", now)} {things}.',
  )
  return dict(total=total, give=give, buy=buy), q, steps, now


@_template(3, 'ages')
def _age_three(d):
  (a, _, _), (b, _, _), (c, _, _) = d.people(3)
  age = d.int(3, 20)
  b_age = 2 * age
  younger = d.int(1, b_age - 1)
  c_age = b_age - younger
  q = (
    f'{a} is {age} years old. {b} is twice as old as {a}. {c} is {younger} years younger '
    f'than {b}. What is the sum of the ages of {a}, {b} and {c}?'
  )
  total = age + b_age + c_age
  steps = (
    f'{b} is {eq(f"2 * {age}", b_age)} years old.',
    f'{c} is {eq(f"{b_age} - {younger}", c_age)} years old.',
    f'The sum of their ages is {eq(f"{age} + {b_age} + {c_age}", total)} years.',
  )
  return dict(age=age, younger=younger), q, steps, total


@_template(3, 'thirds')
def _thirds_cartons(d):
  place, verb, goods, box = d.pick(PACKED_GOODS)
  carton = d.int(2, 12)
  cartons = d.pick([n for n in range(2, 11) if carton * n % 2 == 0])
  kept = carton * cartons  # two thirds of the goods
  third = kept // 2
  total = 3 * third
  q = (
    f'{place} {verb} {total} {goods}. One third of them are sold at the market and the rest '
    f'are packed into {box} of {carton}. How many {box} are filled?'
  )
  steps = (
    f'{eq(f"{total} / 3", third)} {goods} are sold.',
    f'{eq(f"{total} - {third}", kept)} {goods} are packed.',
    f'They fill {eq(f"{kept} / {carton}", cartons)} {box}.',
  )
  return dict(total=total, carton=carton), q, steps, cartons


@_template(3, 'rates')
def _trip_distance(d):
  r1, r2 = 5 * d.int(4, 12), 5 * d.int(4, 12)
  h1, h2 = d.int(1, 4), d.int(1, 4)
  a, _, _ = d.people(1)[0]
  q = (
    f'{a} drives at {r1} miles per hour for {h1} hours and then at {r2} miles per hour '
    f'for {h2} hours. How many miles does {a} drive in all?'
  )
  d1, d2 = r1 * h1, r2 * h2
  total = d1 + d2
  steps = (
    f'First {a} drives {eq(f"{r1} * {h1}", d1)} miles.',
    f'Then {a} drives {eq(f"{r2} * {h2}", d2)} miles.',
    f'In all {a} drives {eq(f"{d1} + {d2}", total)} miles.',
  )
  return dict(r1=r1, h1=h1, r2=r2, h2=h2), q, steps, total


TEMPLATES = tuple(TEMPLATES)
BY_NAME = {t.name: t for t in TEMPLATES}
