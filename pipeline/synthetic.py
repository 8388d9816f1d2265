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
import random
from collections import Counter, deque
from dataclasses import dataclass

from pipeline.corpus import (Conversation, Question, Turn, check_safe_id, render_header,
                             render_session_header, render_turn)


def estimate_tokens(text: str) -> int:
    """Cheap token count: about 4 characters per token, the usual rule of thumb for English
    text under BPE tokenizers (Llama, GPT, SmolLM). Off by maybe 10-20% for a given tokenizer,
    which is good enough to size conversations without loading one."""
    return (len(text) + 3) // 4


# ---------------------------------------------------------------------------------------------
# Topics: openers, chatter templates with slots, slot vocabulary, and the kinds of facts
# ---------------------------------------------------------------------------------------------

def _w(text: str) -> tuple[str, ...]:
    """A vocabulary list written as 'a|b|c' (values may contain commas)."""
    return tuple(v.strip() for v in text.split("|"))


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


_PEAKS = _w("Mount Elbert|Half Dome|Mount Rainier|Pikes Peak|Mount Washington|Longs Peak|"
            "Mount Whitney|Grays Peak|Mount Hood|Mount Adams|Mount Marcy|Clingmans Dome")
_TRAILS = _w("Appalachian Trail|John Muir Trail|Angels Landing trail|Bright Angel Trail|"
             "Skyline Trail|Highline Trail|Pacific Crest Trail|Kalalau Trail|Mist Trail|"
             "Enchanted Valley trail")
_DISHES = _w("chicken curry|mushroom risotto|beef stew|pad thai|lasagna|shakshuka|ramen|paella|"
             "banana bread|dumplings|tacos al pastor|gnocchi")
_PET_KINDS = _w("puppy|dog|kitten|cat|beagle|tabby|golden retriever|corgi|rescue mutt|"
                "border collie")
_SONGS = _w("Bohemian Rhapsody|Hotel California|Clair de Lune|Wonderwall|Blackbird|Superstition|"
            "Take Five|Hallelujah|Dreams|Yesterday")
_INSTRUMENTS = _w("acoustic guitar|piano|violin|ukulele|cello|bass guitar|drum kit|saxophone|"
                  "mandolin|trumpet")
_BANDS = _w("Radiohead|Fleetwood Mac|the Foo Fighters|Arcade Fire|Florence and the Machine|"
            "the Black Keys|Vampire Weekend|Tame Impala|the National|Bon Iver")
_CROPS = _w("tomatoes|zucchini|kale|basil|peppers|strawberries|garlic|cucumbers|pole beans|"
            "lettuce|carrots|pumpkins")
_CITIES = _w("Lisbon|Kyoto|Marrakech|Reykjavik|Buenos Aires|Hanoi|Prague|Cape Town|Istanbul|"
             "Vancouver|Seoul|Copenhagen")
_LANGUAGES = _w("Rust|Go|TypeScript|Python|Kotlin|Elixir|Haskell|Scala|Swift|C++")
_COMPONENTS = _w("authentication service|payment API|caching layer|job scheduler|search indexer|"
                 "mobile backend|billing module|message queue consumer")
_FILMS = _w("Inception|Parasite|Spirited Away|The Godfather|Arrival|Mad Max: Fury Road|Amelie|"
            "Whiplash|Blade Runner 2049|Casablanca|Moonlight|Jaws")
_SKY_OBJECTS = _w("the Andromeda Galaxy|the Orion Nebula|the Pleiades|Saturn|Jupiter|"
                  "the Ring Nebula|Mars|the Crab Nebula|the Hercules Cluster|the Whirlpool Galaxy")
_SHOWERS = _w("Perseid meteor shower|Geminid meteor shower|Leonid meteor shower|"
              "Quadrantid meteor shower|Lyrid meteor shower|Orionid meteor shower")
_PHOTO_SUBJECTS = _w("the city skyline|a waterfall|the harbor lights|old barns|wild horses|"
                     "the bridge at dusk|a foggy forest|fireworks over the river")
_LENSES = _w("50mm prime|85mm portrait lens|wide angle zoom|macro lens|70-200mm telephoto|"
             "35mm prime|fisheye lens")
_BOOKS = _w("Middlemarch|The Remains of the Day|Beloved|One Hundred Years of Solitude|"
            "The Left Hand of Darkness|Pachinko|Dune|Jane Eyre|The Overstory|Never Let Me Go|"
            "Circe|Anna Karenina")

_TOPIC_LIST: tuple[Topic, ...] = (
    Topic(
        name="hiking",
        openers=(
            "Hey {other}, I finally got out on the trails again {when}.",
            "Guess what, {other}? I hiked up {peak} {when}.",
            "So I've been planning my next hike, {other}, and I can't stop looking at trail maps.",
            "Anyway, {other}, I need to tell you about the hike I did {when}.",
            "Have you been hiking lately, {other}? I was out on a mountain trail {when}.",
        ),
        chatter=(
            "The trail up {peak} had {terrain} the whole way and my legs were burning by the summit.",
            "We started at the trailhead before sunrise to beat the crowds on the {trail}.",
            "I always pack {gear} and plenty of water before a long day hike.",
            "The view from the ridge near {peak} was unreal, you could see for miles over the valley.",
            "My knees hate the steep descent on {terrain}, so I bring trekking poles now.",
            "Did you ever hike the {trail}? People say the switchbacks are brutal.",
            "We saw {wildlife} near the creek crossing halfway up the trail.",
            "The elevation gain on that route was about {gain} feet, which is a lot for one day.",
            "Next time I want to go backpacking and camp overnight near an alpine lake.",
            "I got a blister on my heel from {terrain}, so I'm breaking in new hiking socks.",
            "The weather turned near the summit and we hurried down the trail before the storm.",
            "I love how quiet the forest trail gets once you leave the trailhead parking lot behind.",
            "My hiking buddy always forgets {gear}, so I carry a spare in my pack.",
            "A ranger at the trailhead warned us about {wildlife} on the upper switchbacks.",
            "Honestly the hardest part was the scramble over {terrain} right before the peak.",
            "We filtered water from a mountain stream and kept climbing toward the pass.",
            "I downloaded the trail map offline because there's no signal in the backcountry.",
            "Sunset from the summit of {peak} made the whole climb worth it.",
        ),
        words={
            "peak": _PEAKS,
            "trail": _TRAILS,
            "terrain": _w("loose scree|muddy switchbacks|granite slabs|rocky talus|slippery roots|"
                          "steep gravel|knee-deep snow|an exposed ridgeline"),
            "gear": _w("a headlamp|a first aid kit|trekking poles|a rain shell|an extra fleece|"
                       "a water filter|a paper trail map|bear spray|a satellite messenger"),
            "wildlife": _w("a black bear|mountain goats|a moose|a rattlesnake|a herd of elk|marmots|"
                           "a golden eagle|bighorn sheep"),
            "gain": _w("3,000|4,500|2,800|5,200|3,600|6,100"),
        },
        facts=(
            FactSpec("My hiking boots are a pair of {value} that I broke in on a muddy trail.",
                     "What brand of hiking boots does {speaker} wear?",
                     _w("Salomon X Ultra|Merrell Moab|Lowa Renegade|Keen Targhee|Oboz Sawtooth|"
                        "Scarpa Zodiac|La Sportiva Nucleo|Vasque Breeze")),
            FactSpec("The first real mountain I ever summited was {value}, back in college.",
                     "What was the first mountain {speaker} ever summited?", _PEAKS),
            FactSpec("My hiking backpack is a {value} that I found on sale at the gear shop.",
                     "What backpack does {speaker} hike with?",
                     _w("38-liter Osprey Talon|45-liter Gregory Zulu|30-liter Deuter Speed Lite|"
                        "50-liter REI Flash|40-liter Mystery Ranch Coulee")),
            FactSpec("I usually hike with my friend {value}, who knows every trail in the state.",
                     "Who does {speaker} usually hike with?",
                     _w("Marco|Beatrix|Jonah|Wendell|Tomasz|Keiko|Dante|Ruth")),
            FactSpec("It took me {value} to hike to the top of {key}.",
                     "How long did it take {speaker} to hike to the top of {key}?",
                     _w("four hours|five and a half hours|three hours|six hours|seven hours|"
                        "two and a half hours"), _PEAKS),
            FactSpec("On the {key} I camped at a spot called {value}.",
                     "Where did {speaker} camp on the {key}?",
                     _w("Crater Lake Meadow|Hidden Falls Camp|Eagle Rock Flat|Juniper Hollow|"
                        "Silver Creek Camp|Bear Basin|Lost Pine Camp|Marmot Pass Camp"), _TRAILS),
            FactSpec("The trailhead I use for {key} is near a tiny town called {value}.",
                     "Near which town is the trailhead {speaker} uses for {key}?",
                     _w("Leadville|Estes Park|Twisp|Bishop|Gorham|Lake Placid|Ouray|Mazama"), _PEAKS),
        ),
    ),
    Topic(
        name="cooking",
        openers=(
            "Hey {other}, I spent the whole evening in the kitchen {when}.",
            "Oh {other}, I tried a new recipe {when} and it turned out great.",
            "Anyway, {other}, I've been cooking a lot more at home lately.",
            "Quick question, {other}: do you ever cook {dish} from scratch?",
        ),
        chatter=(
            "I made {dish} with {ingredient} and let it simmer for almost an hour.",
            "The secret is to brown the {ingredient} in butter before adding the sauce.",
            "My {tool} is the most used thing in my kitchen, I sear everything in it.",
            "I burned the garlic the first time, so the whole pan of sauce tasted bitter.",
            "Have you ever tried making {dish}? The recipe looked easy but the prep took forever.",
            "I've been experimenting with {spice} in almost every dish this month.",
            "Fresh {ingredient} from the farmers market makes such a difference in flavor.",
            "I finally learned how to make pasta dough by hand without a machine.",
            "The recipe called for {spice}, but I didn't have any so I improvised with paprika.",
            "I've been meal prepping on Sundays, mostly {dish} and roasted vegetables.",
            "Dicing onions with a sharp chef's knife is weirdly satisfying.",
            "My oven runs hot, so I always bake {dish} at a lower temperature.",
            "I marinated the {ingredient} overnight in soy sauce, honey and ginger.",
            "Taste the sauce before you salt it, that's the best cooking advice I ever got.",
            "I want to take a cooking class on knife skills and French sauces.",
            "Deglazing the pan with a splash of white wine made the gravy so rich.",
            "I doubled the recipe for {dish} so we'd have leftovers for lunch.",
            "The dough needed to rest for an hour before I could roll it out and bake it.",
        ),
        words={
            "dish": _DISHES,
            "ingredient": _w("chicken thighs|shiitake mushrooms|chickpeas|salmon|eggplant|shallots|"
                             "short ribs|tofu|fresh basil|sweet potatoes"),
            "tool": _w("cast iron skillet|Dutch oven|wok|stand mixer|pressure cooker|"
                       "carbon steel pan|food processor"),
            "spice": _w("smoked paprika|cumin|cardamom|star anise|sumac|garam masala|saffron|"
                        "za'atar|chipotle powder"),
        },
        facts=(
            FactSpec("My favorite cookbook is {value}, it's covered in sauce stains by now.",
                     "What is {speaker}'s favorite cookbook?",
                     _w("Salt Fat Acid Heat|The Food Lab|Jerusalem|Plenty|"
                        "Mastering the Art of French Cooking|Ottolenghi Simple|Zuni Cafe Cookbook|"
                        "The Flavor Bible")),
            FactSpec("The signature dish I cook for dinner guests is {value}.",
                     "What is the signature dish {speaker} cooks for dinner guests?",
                     _w("lemon saffron risotto|braised lamb shanks|Thai green curry|"
                        "mushroom wellington|coq au vin|miso glazed cod|pork carnitas|"
                        "spinach ricotta cannelloni")),
            FactSpec("My favorite pan is a {value} I found at a flea market.",
                     "What is {speaker}'s favorite pan?",
                     _w("Le Creuset skillet|vintage Griswold skillet|Lodge cast iron pan|"
                        "Mauviel copper saute pan|de Buyer carbon steel pan|Staub braiser")),
            FactSpec("The best restaurant meal I've ever eaten was at {value}.",
                     "At which restaurant did {speaker} eat the best meal of their life?",
                     _w("Le Bernardin|Osteria Francescana|Noma|Chez Panisse|Eleven Madison Park|"
                        "Septime|Gaggan|Asador Etxebarri")),
            FactSpec("For {key} I cooked {value} and everyone asked for the recipe.",
                     "What did {speaker} cook for {key}?",
                     _w("a whole roast duck|seafood paella|vegetable lasagna|beef bourguignon|"
                        "ginger pumpkin soup|chicken tikka masala|stuffed bell peppers|"
                        "honey glazed ham|lobster mac and cheese|mushroom stroganoff"),
                     _w("the birthday dinner|Thanksgiving|the office potluck|New Year's Eve|"
                        "the family reunion|the neighborhood block party|Easter brunch|"
                        "the housewarming party")),
            FactSpec("My grandmother taught me to make {key} with {value} as the secret ingredient.",
                     "What secret ingredient does {speaker} use in {key}?",
                     _w("a spoonful of miso|anchovy paste|brown butter|a pinch of cinnamon|"
                        "fish sauce|smoked salt|orange zest|a splash of espresso|maple syrup|"
                        "pickled ginger"), _DISHES),
            FactSpec("It takes me {value} to make {key} from start to finish.",
                     "How long does it take {speaker} to make {key} from start to finish?",
                     _w("forty minutes|two hours|an hour and a half|twenty-five minutes|"
                        "three hours|fifty minutes"), _DISHES),
        ),
    ),
    Topic(
        name="pets",
        openers=(
            "Hey {other}, the {pet_kind} has been a little menace {when}.",
            "Oh {other}, I have to tell you what my {pet_kind} did {when}.",
            "So, {other}, we took the {pet_kind} to the vet {when}.",
            "Anyway, {other}, how are your pets doing? Mine have been so cuddly lately.",
        ),
        chatter=(
            "The {pet_kind} chewed through {toy} in less than a day.",
            "We go for a walk around the park every morning before I feed the dog.",
            "The vet said the {pet_kind} needs to lose a little weight, so we switched to {food}.",
            "I bought {toy} and now the cat ignores every other toy.",
            "Training the puppy to sit and stay takes so many treats and so much patience.",
            "The kitten sleeps on my keyboard whenever I try to work from home.",
            "Our {pet_kind} barks at the mail carrier every single afternoon.",
            "Grooming day is chaos, there's pet fur all over the bathroom floor.",
            "I'm thinking about adopting another rescue {pet_kind} from the shelter.",
            "The dog park was packed, and the {pet_kind} played fetch for an hour.",
            "The cat purrs so loudly when she curls up on my lap at night.",
            "We had to get a new leash because the old one snapped during a walk.",
            "The {pet_kind} learned to open the treat drawer with a paw.",
            "Flea season is coming, so I booked the vet for a checkup and shots.",
            "Litter box training went way faster than I expected.",
            "Our pets finally get along, the cat even grooms the puppy now.",
            "I set up a pet camera to watch the {pet_kind} while I'm at work.",
        ),
        words={
            "pet_kind": _PET_KINDS,
            "toy": _w("a rope toy|a squeaky hedgehog|a feather wand|a laser pointer|a tennis ball|"
                      "a puzzle feeder|a catnip mouse|a scratching post|a chew bone"),
            "food": _w("a grain-free kibble|a salmon-based food|wet food twice a day|"
                       "a vet prescribed diet|raw food|a senior formula"),
        },
        facts=(
            FactSpec("I named my new puppy {value} because of the color of the fur.",
                     "What is the name of {speaker}'s new puppy?",
                     _w("Biscuit|Pretzel|Maple|Waffles|Nugget|Pepper|Juniper|Mochi|Tofu|Ziggy")),
            FactSpec("Our cat is called {value}, and the cat basically runs the house.",
                     "What is the name of {speaker}'s cat?",
                     _w("Miso|Luna|Oliver|Clementine|Pickles|Salem|Noodle|Pumpkin|Jasper|Binx")),
            FactSpec("My dog's favorite treat is {value}.",
                     "What is the favorite treat of {speaker}'s dog?",
                     _w("frozen blueberries|peanut butter biscuits|dried sweet potato|apple slices|"
                        "chicken jerky|bully sticks|cheese cubes")),
            FactSpec("The vet we trust with our pets is {value}, on the other side of town.",
                     "Which veterinarian does {speaker} take the pets to?",
                     _w("Dr. Okafor|Dr. Lindqvist|Dr. Ramirez|Dr. Chen|Dr. Abernathy|Dr. Novak")),
            FactSpec("I adopted my first dog from {value}.",
                     "Where did {speaker} adopt a first dog?",
                     _w("Happy Tails Rescue|the county animal shelter|Second Chance Paws|"
                        "Mutt Matchers|Bark Haven|Whisker Friends Rescue")),
            FactSpec("When I adopted the {key}, the shelter said its name was {value}.",
                     "According to the shelter, what was the original name of the {key} "
                     "{speaker} adopted?",
                     _w("Captain|Rosie|Bandit|Sprout|Duchess|Gizmo|Hazel|Rocket|Peaches|Scout"),
                     _PET_KINDS),
            FactSpec("At the last vet visit the {key} weighed {value}.",
                     "How much did {speaker}'s {key} weigh at the last vet visit?",
                     _w("12 pounds|18 pounds|27 pounds|9 pounds|34 pounds|41 pounds|7 pounds"),
                     _PET_KINDS),
            FactSpec("The {key} sleeps in {value} every night.",
                     "Where does {speaker}'s {key} sleep every night?",
                     _w("a wicker basket|the laundry basket|a heated bed by the radiator|"
                        "an old armchair|a cardboard box|a plaid dog bed|a cozy igloo bed"),
                     _PET_KINDS),
        ),
    ),
    Topic(
        name="music",
        openers=(
            "Hey {other}, I've had a song stuck in my head since {when}.",
            "Guess what, {other}? I went to a concert {when} and it was amazing.",
            "So {other}, I've been practicing the {instrument} every evening.",
            "Anyway, {other}, what music have you been listening to lately?",
        ),
        chatter=(
            "I've been practicing scales on the {instrument} for thirty minutes a day.",
            "The band played {song} as an encore and the whole crowd sang along.",
            "I finally nailed the chord changes in {song} without looking at my fingers.",
            "The acoustics at {venue} are incredible, every note sounds clear.",
            "My guitar teacher says I need to work on my rhythm and practice with a metronome.",
            "I made a playlist of {genre} songs for late-night drives.",
            "Have you heard the new album? The bass lines and the drums are so groovy.",
            "I want to learn music theory so I can write my own melodies and chords.",
            "We jammed in my friend's garage with drums, bass and two electric guitars.",
            "Vinyl records sound warmer to me, so I started collecting albums.",
            "The singer hit that high note in {song} and I got goosebumps.",
            "I'm restringing my {instrument} because the strings sound dull.",
            "Our choir is rehearsing harmonies for the spring concert.",
            "Live {genre} at {venue} is the best way to spend a Friday night.",
            "I recorded a demo song with a cheap microphone and some headphones.",
            "Learning to read sheet music has changed how I play the {instrument}.",
            "The festival lineup has three bands I've wanted to hear live for years.",
        ),
        words={
            "instrument": _INSTRUMENTS,
            "song": _SONGS,
            "venue": _w("the Fillmore|Red Rocks|the Blue Note|the Ryman|the Royal Albert Hall|"
                        "the Hollywood Bowl|a tiny jazz club downtown"),
            "genre": _w("jazz|indie rock|bluegrass|classical piano|synthwave|blues|folk|funk|"
                        "bossa nova"),
        },
        facts=(
            FactSpec("The first concert I ever went to was {value}, when I was fifteen.",
                     "Who did {speaker} see at the first concert {speaker} ever went to?",
                     _w("Coldplay|Green Day|Taylor Swift|Beyonce|Bruce Springsteen|Adele|"
                        "The Killers|Paramore|Muse")),
            FactSpec("My first guitar was a {value} that I bought used.",
                     "What was {speaker}'s first guitar?",
                     _w("Fender Stratocaster|Gibson Les Paul|Yamaha FG800|Epiphone Casino|"
                        "Martin D-28|Taylor GS Mini|Ibanez RG")),
            FactSpec("My music teacher is {value}, who is very strict about posture.",
                     "Who is {speaker}'s music teacher?",
                     _w("Mrs. Petrova|Mr. Alvarez|Ms. Nakamura|Mr. Okonkwo|Mrs. Haldane|Mr. Brennan")),
            FactSpec("My favorite album of all time is {value}.",
                     "What is {speaker}'s favorite album of all time?",
                     _w("Kind of Blue|Rumours|OK Computer|Abbey Road|Songs in the Key of Life|"
                        "Pet Sounds|Purple Rain|The Dark Side of the Moon")),
            FactSpec("I saw {key} live at {value}.",
                     "Where did {speaker} see {key} live?",
                     _w("Madison Square Garden|Red Rocks Amphitheatre|the Hollywood Bowl|"
                        "Wembley Stadium|the Gorge Amphitheatre|the Ryman Auditorium|Glastonbury|"
                        "Coachella|the Royal Albert Hall"), _BANDS),
            FactSpec("I've been learning to play {key} on the {value}, slowly.",
                     "On which instrument is {speaker} learning to play {key}?",
                     _INSTRUMENTS, _SONGS),
            FactSpec("I performed {key} at {value}.",
                     "Where did {speaker} perform {key}?",
                     _w("my cousin's wedding|an open mic night|the school talent show|"
                        "a coffee shop gig|the church hall|a friend's birthday party|"
                        "a street fair downtown"), _SONGS),
        ),
    ),
    Topic(
        name="gardening",
        openers=(
            "Hey {other}, I spent {when} out in the garden pulling weeds.",
            "Oh {other}, my {plant} finally started sprouting {when}!",
            "Anyway, {other}, I've been planning the vegetable beds for next season.",
            "So {other}, do you garden at all? I'm getting obsessed with my backyard beds.",
        ),
        chatter=(
            "I planted a row of {plant} along the fence where it gets full sun.",
            "The soil here is heavy clay, so I dug in a lot of {amendment}.",
            "Aphids are all over my {plant} again, I might release ladybugs.",
            "I water the raised beds early in the morning before it gets hot.",
            "My compost pile finally turned into dark crumbly soil.",
            "The {flower} bloomed this week and the bees are going wild.",
            "I'm starting seeds indoors under grow lights until the last frost.",
            "Pruning the {shrub} back hard in early spring makes it bushier.",
            "Mulching around the {plant} keeps the weeds down and the roots cool.",
            "The tomatoes are ripening on the vine faster than I can pick them.",
            "I dug up the bulbs and divided them so they'd spread across the flower border.",
            "A deer got into the garden and ate half the {plant} overnight.",
            "I'm building a trellis so the climbing beans have something to grab.",
            "Slugs chewed holes in every lettuce leaf, so I set beer traps in the beds.",
            "The seed catalog came and I circled way too many varieties of {plant}.",
            "Drip irrigation saved me so much time watering the vegetable beds.",
            "Deadheading the {flower} keeps them flowering until autumn.",
        ),
        words={
            "plant": _CROPS,
            "flower": _w("dahlias|peonies|sunflowers|lavender|hydrangeas|zinnias|tulips|"
                         "marigolds|roses"),
            "shrub": _w("lilac|boxwood hedge|butterfly bush|blueberry bushes|forsythia|rose bushes"),
            "amendment": _w("aged compost|leaf mold|worm castings|peat-free potting mix|"
                            "composted manure|coarse sand"),
        },
        facts=(
            FactSpec("The tomato variety I swear by is {value}.",
                     "Which tomato variety does {speaker} swear by?",
                     _w("Cherokee Purple|Brandywine|Sungold|San Marzano|Green Zebra|Black Krim|"
                        "Mortgage Lifter|Early Girl")),
            FactSpec("There's a {value} in my garden that my dad planted years ago.",
                     "What tree did {speaker}'s dad plant in the garden?",
                     _w("Japanese maple|Honeycrisp apple tree|fig tree|weeping willow|"
                        "Meyer lemon tree|magnolia|cherry tree|pear tree")),
            FactSpec("My community garden plot is number {value}.",
                     "What is the number of {speaker}'s community garden plot?",
                     _w("14|27|8|42|31|19|56|63")),
            FactSpec("This year my biggest {key} weighed {value}.",
                     "How much did {speaker}'s biggest {key} weigh this year?",
                     _w("eleven pounds|four pounds|23 pounds|two pounds|seven pounds|three pounds|"
                        "sixteen pounds"),
                     _w("pumpkin|zucchini|watermelon|cabbage|squash|eggplant|cucumber|"
                        "sweet potato")),
            FactSpec("I got my {key} seeds from {value}.",
                     "Where did {speaker} get the {key} seeds?",
                     _w("Baker Creek|a seed swap at the library|my neighbor Doris|Johnny's Seeds|"
                        "the botanical garden sale|my grandfather's old seed tin|Territorial Seed|"
                        "a farm stand in Vermont"), _CROPS),
            FactSpec("This season I planted the {key} in {value}.",
                     "Where did {speaker} plant the {key} this season?",
                     _w("the raised bed by the shed|a row of grow bags|the south-facing border|"
                        "half wine barrels|the greenhouse|terracotta pots on the patio"), _CROPS),
        ),
    ),
    Topic(
        name="fitness",
        openers=(
            "Hey {other}, I went to the gym {when} and I'm so sore today.",
            "Guess what, {other}? I set a new record on {exercise} {when}.",
            "Anyway, {other}, I've started a new workout program at the gym.",
            "So {other}, have you been working out much lately?",
        ),
        chatter=(
            "I did five sets of {exercise} and my legs are shaking.",
            "My trainer added {exercise} to every workout, which hurts in a good way.",
            "I'm following a {program} program three days a week.",
            "I track my protein now, about 120 grams a day to build muscle.",
            "Rest days are important, my muscles need time to recover after lifting.",
            "The spin class at 6 am is brutal but it wakes me up.",
            "I finally did a pull-up without the resistance band!",
            "Foam rolling after my workout helps my hamstrings so much.",
            "I'm training for a {race}, so I run intervals on Tuesdays.",
            "My heart rate hit 175 during the sprint intervals.",
            "Deadlifts with good form are all about bracing your core.",
            "I signed up for a {fclass} class at the gym near my office.",
            "Stretching every morning fixed my lower back pain.",
            "I added ten pounds to my squat this month.",
            "My running shoes have almost 400 miles on them, time for a new pair.",
            "The {fclass} instructor made us hold a plank for three minutes.",
            "Consistency beats intensity, I just try to show up at the gym every day.",
        ),
        words={
            "exercise": _w("barbell squats|deadlifts|bench press|kettlebell swings|burpees|lunges|"
                           "pull-ups|box jumps|overhead press|rowing sprints"),
            "program": _w("push pull legs|5x5 strength|couch to 5K|CrossFit|full body|"
                          "high intensity interval"),
            "race": _w("half marathon|10K race|marathon|triathlon|trail run|charity 5K"),
            "fclass": _w("spin|Pilates|kickboxing|HIIT|barre|boxing|circuit training"),
        },
        facts=(
            FactSpec("My gym is {value}, just two blocks from my apartment.",
                     "Which gym does {speaker} go to?",
                     _w("Iron Temple|Peak Performance|the downtown YMCA|Gold's Gym|Crunch Fitness|"
                        "Equinox|Forge Athletic Club")),
            FactSpec("My personal trainer is named {value}.",
                     "What is the name of {speaker}'s personal trainer?",
                     _w("Coach Dmitri|Jess Harlow|Marcus Bell|Tanya Ruiz|Leo Fischer|Aisha Grant")),
            FactSpec("My running shoes are {value}, and my feet finally stopped hurting.",
                     "What running shoes does {speaker} wear?",
                     _w("Hoka Clifton|Brooks Ghost|Nike Pegasus|Asics Gel-Nimbus|New Balance 1080|"
                        "Saucony Ride|On Cloudmonster")),
            FactSpec("My personal record on {key} is {value}.",
                     "What is {speaker}'s personal record on {key}?",
                     _w("225 pounds|315 pounds|185 pounds|135 pounds|275 pounds|405 pounds|"
                        "155 pounds"),
                     _w("the deadlift|the back squat|the bench press|the overhead press|"
                        "the front squat|the clean and jerk|the power clean|the sumo deadlift")),
            FactSpec("I ran the {key} in {value}.",
                     "How long did it take {speaker} to run the {key}?",
                     _w("3 hours 58 minutes|1 hour 47 minutes|24 minutes|52 minutes|"
                        "4 hours 12 minutes|1 hour 33 minutes|49 minutes"),
                     _w("Chicago Marathon|Brooklyn Half|Turkey Trot 5K|Bay to Breakers|"
                        "Peachtree 10K|Cherry Blossom Ten Miler|Big Sur Marathon|"
                        "Rock 'n' Roll Half Marathon")),
            FactSpec("For the {key} I trained with {value}.",
                     "Who did {speaker} train with for the {key}?",
                     _w("my sister Ada|a running club called the Early Birds|my coworker Priscilla|"
                        "an online running coach|my neighbor Gus|the November Project group"),
                     _w("Chicago Marathon|Brooklyn Half|Turkey Trot 5K|Bay to Breakers|"
                        "Peachtree 10K|Cherry Blossom Ten Miler|Big Sur Marathon|"
                        "Rock 'n' Roll Half Marathon")),
            FactSpec("My {key} class at the gym is on {value}.",
                     "When is {speaker}'s {key} class at the gym?",
                     _w("Monday evenings|Tuesday mornings|Wednesday at noon|Thursday evenings|"
                        "Saturday mornings|Sunday afternoons"),
                     _w("spin|Pilates|kickboxing|HIIT|barre|boxing|circuit training")),
        ),
    ),
    Topic(
        name="travel",
        openers=(
            "Hey {other}, I just got back from my trip to {city} {when}.",
            "Guess what, {other}? I booked flights for my next vacation.",
            "Anyway, {other}, I've been daydreaming about traveling abroad again.",
            "So {other}, where would you fly if you could go anywhere tomorrow?",
        ),
        chatter=(
            "The flight to {city} had a long layover, but the airport lounge was nice.",
            "We stayed in a tiny {lodging} near the old town and walked everywhere.",
            "I always travel with a carry-on only, it makes connecting flights easier.",
            "The street food in {city} was the highlight of the whole trip.",
            "Jet lag hit me hard, I was wide awake at 4 am the first night in the hotel.",
            "We took the overnight train out of {city} and watched the countryside roll by.",
            "My passport expires next year, so I need to renew it before I book anything.",
            "The museum tour in {city} took a whole day and I still didn't see everything.",
            "I learned a few phrases in {language} so I could order at cafes.",
            "We rented a car and drove along the coast for a week.",
            "The hotel upgraded us to a room with a balcony over the harbor.",
            "Exchange rates were great, so everything felt cheap on that vacation.",
            "I collect a fridge magnet from every country I visit.",
            "Customs took two hours because three international flights landed at once.",
            "Our tour guide in {city} knew every hidden alley and rooftop bar.",
            "I use a packing list so I never forget my travel adapter again.",
            "Backpacking through {region} on a budget taught me so much.",
        ),
        words={
            "city": _CITIES,
            "lodging": _w("guesthouse|boutique hotel|hostel|bed and breakfast|apartment rental|"
                          "ryokan|riad"),
            "language": _w("Portuguese|Japanese|Italian|Vietnamese|Spanish|Turkish|Czech|Greek"),
            "region": _w("Southeast Asia|South America|the Balkans|Central Europe|Scandinavia|"
                         "North Africa"),
        },
        facts=(
            FactSpec("My dream destination is {value}.",
                     "What is {speaker}'s dream destination?",
                     _w("Patagonia|the Maldives|Bhutan|New Zealand|the Amalfi Coast|Machu Picchu|"
                        "Santorini|Zanzibar|the Faroe Islands")),
            FactSpec("I have visited exactly {value} countries so far.",
                     "How many countries has {speaker} visited?",
                     _w("17|23|9|31|12|41|6|28")),
            FactSpec("My favorite airline is {value} because the seats are comfy.",
                     "What is {speaker}'s favorite airline?",
                     _w("Singapore Airlines|KLM|Emirates|Qantas|Icelandair|Japan Airlines|"
                        "Turkish Airlines|Air New Zealand")),
            FactSpec("In {key} we stayed at a place called {value}.",
                     "Where did {speaker} stay in {key}?",
                     _w("Hotel Aurora|Casa Azul|the Blue Door Inn|Villa Serena|the Lantern Hostel|"
                        "Maison Rouge|the Harbor View Lodge|Hotel Solstice|Pension Edelweiss|"
                        "the Olive Tree Riad"), _CITIES),
            FactSpec("The best thing I ate in {key} was {value}.",
                     "What was the best thing {speaker} ate in {key}?",
                     _w("grilled sardines|matcha soft serve|lamb tagine|pho with brisket|"
                        "beef empanadas|goulash|bunny chow|fresh stroopwafels|bibimbap|"
                        "smoked salmon on rye"), _CITIES),
            FactSpec("On my trip to {key} I flew with {value}.",
                     "Which airline did {speaker} fly with to {key}?",
                     _w("Lufthansa|TAP Air Portugal|Delta|Air France|Finnair|Korean Air|"
                        "Ethiopian Airlines|Aer Lingus"), _CITIES),
        ),
    ),
    Topic(
        name="programming",
        openers=(
            "Hey {other}, work has been crazy, we shipped a big software release {when}.",
            "Ugh, {other}, I spent {when} chasing a bug in production.",
            "Anyway, {other}, I've been learning {language} in my spare time.",
            "So {other}, how is your job going? My team is refactoring the whole codebase.",
        ),
        chatter=(
            "The bug turned out to be a race condition in the {component}.",
            "I rewrote the {component} in {language} and it's twice as fast.",
            "Code review took forever because the pull request touched forty files.",
            "Our CI pipeline keeps failing on a flaky integration test.",
            "I finally set up {tool} and my development workflow is so much smoother.",
            "We had a production outage because someone deployed code on a Friday.",
            "The database query was missing an index, so it scanned millions of rows.",
            "I pair-programmed with a junior developer on the {component} all afternoon.",
            "Writing unit tests first actually helped me design the API better.",
            "The stack trace pointed to a null pointer in the {component}.",
            "Our sprint planning meeting ran two hours over.",
            "I'm migrating the old monolith to microservices, one endpoint at a time.",
            "The memory leak only shows up under heavy load, which makes it hard to debug.",
            "I spent the morning reading the documentation for {tool}.",
            "Merge conflicts in the config files are the worst part of my week.",
            "We're adopting {language} for the new backend service.",
            "The compiler error messages in {language} are actually really helpful.",
        ),
        words={
            "language": _LANGUAGES,
            "component": _COMPONENTS,
            "tool": _w("Docker|Kubernetes|Terraform|a new debugger|Neovim|GitHub Actions|"
                       "Grafana dashboards|a profiler"),
        },
        facts=(
            FactSpec("I work as a {value} at a small software startup.",
                     "What is {speaker}'s job title?",
                     _w("backend engineer|site reliability engineer|data engineer|"
                        "frontend developer|machine learning engineer|mobile developer|"
                        "security engineer")),
            FactSpec("My company is called {value}, we build logistics software.",
                     "What is the name of the company where {speaker} works?",
                     _w("Quillbyte|Northwind Labs|Cobalt Systems|Trellis Data|Brightforge|"
                        "Parallax Software|Kitebird|Lumen Grid")),
            FactSpec("My favorite code editor is {value}.",
                     "What is {speaker}'s favorite code editor?",
                     _w("Vim|Emacs|VS Code|IntelliJ IDEA|Sublime Text|Helix|Zed")),
            FactSpec("My first programming language was {value}.",
                     "What was {speaker}'s first programming language?",
                     _w("BASIC|Pascal|Java|JavaScript|Visual Basic|Perl|Fortran|Lua")),
            FactSpec("The {key} at my job is written in {value}.",
                     "What language is the {key} at {speaker}'s job written in?",
                     _LANGUAGES, _COMPONENTS),
            FactSpec("Our team's {key} is named {value}.",
                     "What is the name of the {key} on {speaker}'s team?",
                     _w("Hermes|Gandalf|Bluebird|Atlas|Pegasus|Marvin|Cerberus|Nimbus|Zephyr"),
                     _w("build server|staging cluster|production database|deploy bot|"
                        "monitoring dashboard|test runner|release branch|on-call pager bot")),
            FactSpec("The {key} at my job runs on {value}.",
                     "What does the {key} at {speaker}'s job run on?",
                     _w("AWS Lambda|a Kubernetes cluster|bare-metal servers|Google Cloud Run|"
                        "Heroku|Azure Functions|a fleet of EC2 instances"), _COMPONENTS),
            FactSpec("My last on-call incident with the {key} lasted {value}.",
                     "How long did {speaker}'s last on-call incident with the {key} last?",
                     _w("six hours|forty minutes|two days|ninety minutes|eleven hours|"
                        "twenty minutes"), _COMPONENTS),
        ),
    ),
    Topic(
        name="movies",
        openers=(
            "Hey {other}, I watched {film} {when} and I can't stop thinking about it.",
            "Guess what, {other}? I went to the cinema {when}.",
            "Anyway, {other}, have you seen any good movies lately?",
            "So {other}, I've been on a {genre} movie marathon all week.",
        ),
        chatter=(
            "The cinematography in {film} was stunning, every shot looked like a painting.",
            "I cried during the ending of {film}, the film score really got me.",
            "The plot twist in the third act was so obvious in hindsight.",
            "I love {director} films, the dialogue always feels so sharp.",
            "We watched a {genre} double feature with a huge bowl of popcorn.",
            "The lead actor's performance deserved an Oscar nomination.",
            "The sequel was way worse than the original movie.",
            "I'm rewatching {film} because I missed half the foreshadowing the first time.",
            "The special effects looked cheap, but the story carried the film.",
            "There's a film festival downtown with a bunch of indie premieres.",
            "I prefer seeing movies in the theater for the big screen and the sound.",
            "The director's cut of {film} adds twenty minutes of extra scenes.",
            "The casting of the villain in that movie was perfect, so creepy.",
            "Subtitled {genre} films are my favorite discovery this year.",
            "I wrote a review of {film} on my movie blog.",
            "The trailer spoiled the best scene of the whole movie.",
            "Our movie club argues about the ending of every film we watch.",
        ),
        words={
            "film": _FILMS,
            "director": _w("Christopher Nolan|Greta Gerwig|Bong Joon-ho|Denis Villeneuve|"
                           "Hayao Miyazaki|Martin Scorsese|Agnes Varda|Wes Anderson"),
            "genre": _w("horror|science fiction|film noir|romantic comedy|documentary|western|"
                        "animated|thriller"),
        },
        facts=(
            FactSpec("My all-time favorite movie is {value}, I've seen it a dozen times.",
                     "What is {speaker}'s all-time favorite movie?",
                     _w("The Shawshank Redemption|Pulp Fiction|The Princess Bride|"
                        "Back to the Future|Alien|Rear Window|Chinatown|Some Like It Hot")),
            FactSpec("The movie theater I usually go to is {value}.",
                     "Which movie theater does {speaker} usually go to?",
                     _w("the Rialto|the Paramount|the Roxy|the Majestic|the Orpheum|the Bijou")),
            FactSpec("My favorite actor is {value}.",
                     "Who is {speaker}'s favorite actor?",
                     _w("Cate Blanchett|Denzel Washington|Tilda Swinton|Mahershala Ali|"
                        "Meryl Streep|Song Kang-ho|Frances McDormand|Keanu Reeves")),
            FactSpec("I watched {key} at {value}.",
                     "Where did {speaker} watch {key}?",
                     _w("the Alamo Drafthouse|a drive-in theater|the Castro Theatre|"
                        "an IMAX in Chicago|a film festival in Toronto|my cousin's home theater|"
                        "an open-air cinema in the park|the Prince Charles Cinema"), _FILMS),
            FactSpec("I'd give {key} a rating of {value}.",
                     "What rating did {speaker} give {key}?",
                     _w("seven out of ten|nine out of ten|four out of ten|six out of ten|"
                        "three out of ten|eight out of ten"), _FILMS),
            FactSpec("I first watched {key} with {value}.",
                     "Who did {speaker} first watch {key} with?",
                     _w("my brother Sam|my college roommate|my grandmother|a first date|"
                        "my film club|my neighbor Petra|my cousin Leo"), _FILMS),
        ),
    ),
    Topic(
        name="astronomy",
        openers=(
            "Hey {other}, I was out stargazing {when} and the sky was so clear.",
            "Guess what, {other}? I finally saw {object} through my telescope.",
            "Anyway, {other}, there's a meteor shower coming up soon.",
            "So {other}, have you ever looked at the night sky far from city lights?",
        ),
        chatter=(
            "I set up the telescope in the backyard and found {object} right away.",
            "The {shower} peaked around 2 am and I counted dozens of meteors.",
            "Light pollution in the city makes it impossible to see the Milky Way.",
            "I'm learning to find constellations like {constellation} without a star app.",
            "Saturn's rings looked tiny but crisp through the eyepiece.",
            "We drove to a dark sky park to photograph the galactic core.",
            "The moon was too bright, so the faint nebulae washed out.",
            "I joined an astronomy club that meets at the observatory every month.",
            "Jupiter's four biggest moons lined up in a row last night.",
            "I'm saving up for a bigger {scope} to see deep sky objects.",
            "The total solar eclipse was the most amazing thing I've ever seen in the sky.",
            "Did you know light from {object} takes ages to reach us?",
            "My star chart app shows when the International Space Station passes overhead.",
            "Collimating the mirrors on the telescope took me an hour.",
            "Cold nights have the steadiest air for viewing planets.",
            "I stayed up to watch the northern lights glowing green over the horizon.",
            "{constellation} is easy to spot in the night sky if you know where to look.",
        ),
        words={
            "object": _SKY_OBJECTS,
            "shower": _SHOWERS,
            "constellation": _w("Orion|Cassiopeia|Cygnus|Scorpius|Ursa Major|Lyra|Perseus|"
                                "Sagittarius"),
            "scope": _w("Dobsonian telescope|refractor telescope|Schmidt-Cassegrain telescope|"
                        "pair of astronomy binoculars|equatorial mount"),
        },
        facts=(
            FactSpec("My telescope is a {value} that my aunt gave me.",
                     "What telescope does {speaker} own?",
                     _w("Celestron NexStar 8SE|Orion SkyQuest XT8|Sky-Watcher Dobsonian 10|"
                        "Meade LX90|Explore Scientific AR102|Celestron AstroMaster 130")),
            FactSpec("My favorite constellation is {value}.",
                     "What is {speaker}'s favorite constellation?",
                     _w("Andromeda|Draco|Aquila|Pegasus|Corona Borealis|Bootes|Auriga|Gemini")),
            FactSpec("The observatory where I volunteer is {value}.",
                     "Which observatory does {speaker} volunteer at?",
                     _w("Griffith Observatory|Lowell Observatory|Yerkes Observatory|"
                        "Lick Observatory|McDonald Observatory|Chabot Space Center")),
            FactSpec("I first saw {key} from {value}.",
                     "Where did {speaker} first see {key}?",
                     _w("Cherry Springs State Park|the Atacama Desert|Mauna Kea|"
                        "my grandparents' farm in Kansas|Big Bend National Park|"
                        "a beach in Portugal|Death Valley|the Scottish Highlands"), _SKY_OBJECTS),
            FactSpec("During the {key} I counted {value} meteors in one hour.",
                     "How many meteors did {speaker} count in one hour during the {key}?",
                     _w("47|83|29|112|64|38|95"), _SHOWERS),
            FactSpec("Through my eyepiece {key} looked best at {value} magnification.",
                     "At what magnification did {key} look best to {speaker}?",
                     _w("48x|120x|75x|200x|32x|150x|96x"), _SKY_OBJECTS),
            FactSpec("I learned to find {key} in the sky from {value}.",
                     "Who taught {speaker} to find {key} in the sky?",
                     _w("my grandfather|a park ranger|my science teacher|"
                        "an astronomy club member|my uncle Ray|a planetarium guide"),
                     _w("Orion|Cassiopeia|Cygnus|Scorpius|Ursa Major|Lyra|Perseus|Sagittarius")),
        ),
    ),
    Topic(
        name="photography",
        openers=(
            "Hey {other}, I went out with my camera {when} to catch the golden hour.",
            "Guess what, {other}? One of my photos got into a local exhibition.",
            "Anyway, {other}, I've been editing photos all weekend.",
            "So {other}, I'm thinking about upgrading my camera gear.",
        ),
        chatter=(
            "I shot the whole afternoon with my {lens} and loved the sharpness.",
            "Golden hour light makes every portrait photo look warm and soft.",
            "I bracketed the exposures and merged them into an HDR image.",
            "Editing in {software} takes me longer than actually shooting photos.",
            "A fast shutter speed froze the birds mid-flight.",
            "I shoot in RAW so I can recover the highlights later.",
            "The rule of thirds is a good start for composition, but breaking it works too.",
            "I photographed {subject} with a long exposure on a tripod.",
            "My camera sensor had dust spots, so every sky looked speckled.",
            "I'm practicing street photography, candid shots of people downtown.",
            "The aperture at f/1.8 blurs the background beautifully.",
            "I developed my first roll of black and white film at home.",
            "The light was flat and overcast, so I photographed textures instead.",
            "I've been printing my favorite shots on matte paper for the wall.",
            "ISO noise ruined some of the night shots, so I need a faster lens.",
            "Framing {subject} through an archway made a great composition.",
            "My photo walk group meets every Sunday to shoot a new neighborhood.",
        ),
        words={
            "lens": _LENSES,
            "software": _w("Lightroom|Photoshop|Capture One|darktable|Affinity Photo"),
            "subject": _PHOTO_SUBJECTS,
        },
        facts=(
            FactSpec("My main camera is a {value}, I bought it secondhand.",
                     "What is {speaker}'s main camera?",
                     _w("Fujifilm X-T4|Canon EOS R6|Nikon Z6|Sony A7 III|Olympus OM-D E-M1|"
                        "Leica Q2|Pentax K-1")),
            FactSpec("The photographer who inspires me most is {value}.",
                     "Which photographer inspires {speaker} most?",
                     _w("Ansel Adams|Vivian Maier|Annie Leibovitz|Henri Cartier-Bresson|"
                        "Dorothea Lange|Sebastiao Salgado|Fan Ho")),
            FactSpec("My favorite film stock is {value}.",
                     "What is {speaker}'s favorite film stock?",
                     _w("Kodak Portra 400|Ilford HP5|Fujifilm Superia|Kodak Tri-X|Cinestill 800T|"
                        "Kodak Ektar 100")),
            FactSpec("I photographed {key} with the {value}.",
                     "Which lens did {speaker} use to photograph {key}?",
                     _LENSES, _PHOTO_SUBJECTS),
            FactSpec("My photo of {key} won {value}.",
                     "What did {speaker}'s photo of {key} win?",
                     _w("first place at the county fair|an honorable mention in a magazine contest|"
                        "second place at the camera club|a spot in a gallery show|"
                        "a gift card from the photo shop|the people's choice award"),
                     _PHOTO_SUBJECTS),
            FactSpec("For {key} I used a shutter speed of {value}.",
                     "What shutter speed did {speaker} use for {key}?",
                     _w("1/1000 of a second|30 seconds|1/60 of a second|two seconds|"
                        "1/250 of a second|eight seconds"), _PHOTO_SUBJECTS),
            FactSpec("I edited my photos of {key} in {value}.",
                     "Which software did {speaker} use to edit the photos of {key}?",
                     _w("Lightroom|Photoshop|Capture One|darktable|Affinity Photo|Luminar"),
                     _PHOTO_SUBJECTS),
        ),
    ),
    Topic(
        name="books",
        openers=(
            "Hey {other}, I stayed up way too late reading {when}.",
            "Guess what, {other}? I finished reading {book} {when}.",
            "Anyway, {other}, my book club picked a new novel.",
            "So {other}, what books are you reading these days?",
        ),
        chatter=(
            "The last chapter of {book} completely changed how I saw the narrator.",
            "My book club argued for an hour about the ending of {book}.",
            "I read mostly {genre} novels before bed.",
            "{author} writes such beautiful prose, I keep underlining sentences.",
            "I finally got a library card and borrowed a stack of paperbacks.",
            "Audiobooks make my commute fly by, I'm halfway through a long novel.",
            "The used bookstore downtown has shelves of books up to the ceiling.",
            "I'm trying to read fifty books this year and I'm a bit behind.",
            "The character development in {book} was so subtle and clever.",
            "I annotate the margins of my books in pencil, my friends think it's a crime.",
            "The sequel comes out next spring, I preordered the hardcover.",
            "Reading poetry slowly out loud changed how I understand it.",
            "I can't read horror novels at night, the chapters stick with me.",
            "The translation of {book} I read was smooth and lyrical.",
            "I keep a reading journal with quotes from every novel.",
            "My e-reader is great for travel, but I still love paper books.",
            "{author} has a new novel coming out and the reviews are glowing.",
        ),
        words={
            "book": _BOOKS,
            "author": _w("Toni Morrison|Kazuo Ishiguro|Ursula K. Le Guin|Gabriel Garcia Marquez|"
                         "Zadie Smith|Haruki Murakami|Jane Austen|Chimamanda Ngozi Adichie"),
            "genre": _w("literary fiction|mystery|fantasy|historical fiction|speculative fiction|"
                        "memoir|short story"),
        },
        facts=(
            FactSpec("My favorite novel of all time is {value}.",
                     "What is {speaker}'s favorite novel?",
                     _w("The Brothers Karamazov|Pride and Prejudice|The Name of the Wind|Wolf Hall|"
                        "Rebecca|Things Fall Apart|The Secret History|Moby-Dick")),
            FactSpec("My book club is called {value}.",
                     "What is the name of {speaker}'s book club?",
                     _w("The Dog-Eared Pages|Chapter and Verse|The Midnight Readers|Spine Breakers|"
                        "The Bookworm Society|Between the Lines")),
            FactSpec("The bookstore I love most is {value}.",
                     "Which bookstore does {speaker} love most?",
                     _w("Powell's Books|The Strand|City Lights|Shakespeare and Company|"
                        "Book Passage|Elliott Bay Book Company")),
            FactSpec("I borrowed my copy of {key} from {value}.",
                     "From whom did {speaker} borrow a copy of {key}?",
                     _w("my aunt Rosa|the public library|my coworker Ben|my old roommate|"
                        "my neighbor Hal|a little free library|my sister Nora|my professor"),
                     _BOOKS),
            FactSpec("It took me {value} to finish {key}.",
                     "How long did it take {speaker} to finish {key}?",
                     _w("two weeks|three days|a month|a single weekend|six weeks|four days|"
                        "ten days"), _BOOKS),
            FactSpec("I first read {key} when I was {value} years old.",
                     "How old was {speaker} when first reading {key}?",
                     _w("twelve|sixteen|nineteen|twenty-three|thirty|fourteen|twenty-seven"),
                     _BOOKS),
        ),
    ),
)

_TOPICS_BY_NAME: dict[str, Topic] = {t.name: t for t in _TOPIC_LIST}
TOPICS: tuple[str, ...] = tuple(t.name for t in _TOPIC_LIST)

# Short, topic-free sentences that some turns start with, so turns do not all open the same way.
_INTERJECTIONS = _w("Oh nice!|Ha, love that.|Wow.|That's so cool.|No way!|Same here.|"
                    "Oh, interesting.|Ha!|Right?|Totally.|Nice one.|Good for you!")
# ... and that some one-sentence turns end with, handing the word to the other speaker.
_CLOSERS = _w("What about you?|Have you ever tried that?|I'll keep you posted.|"
              "Anyway, that's my week.|What do you think?|Any tips?|You'd love it.|"
              "Crazy, right?|How about you, {other}?|I'll tell you more next time.")
_WHEN = _w("last weekend|yesterday|on Saturday morning|this past Sunday|last night|"
           "earlier this week|on Friday evening|a few days ago")
_SPEAKER_NAMES = _w("Alice|Bob|Caroline|Melanie|Jon|Gina|Tomas|Yuki|Omar|Fatima|Lukas|Sofia|"
                    "Mateo|Hannah|Daniel|Grace|Kwame|Ravi|Elena|Noah|Chloe|Samir|Maya|Felix|"
                    "Aiko|Diego|Leila|Oscar|Nadia|Theo")
_MONTHS = _w("January|February|March|April|May|June|July|August|September|October|November|"
             "December")


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


def make_corpus(n_conversations: int, target_tokens: int, seed: int,
                n_topics: int = 4) -> list[Conversation]:
    """`n_conversations` conversations 'synth-0000', 'synth-0001', ..., each from its own
    sub-seed derived from (seed, index), so adding conversations never changes earlier ones."""
    corpus = []
    for i in range(n_conversations):
        sub_seed = random.Random(f"synthetic-corpus/{seed}/{i}").getrandbits(32)
        corpus.append(make_conversation(f"synth-{i:04d}", target_tokens, sub_seed, n_topics))
    return corpus
