"""The word list behind the reversal, copying and tool tasks: short, common, lowercase English
words, none a palindrome (its reversal must differ from the word itself). Order matters: the
generator's splits are drawn from it, so append new words at the end."""

WORDS = (
    "apple", "bread", "chair", "dance", "eagle", "flame", "grape", "house", "index", "juice",
    "knife", "lemon", "magic", "night", "ocean", "piano", "quiet", "river", "stone", "table",
    "unity", "voice", "water", "young", "zebra", "cat", "dog", "sun", "moon", "tree",
    "bird", "fish", "rain", "snow", "wind", "fire", "lamp", "door", "book", "milk",
    "salt", "ship", "road", "hill", "lake", "rock", "sand", "leaf", "rose", "corn",
    "bell", "coin", "desk", "drum", "frog", "gold", "hand", "king", "kite", "lion",
    "mint", "nest", "owl", "pen", "pig", "ring", "rope", "seed", "sock", "star",
    "tent", "tiger", "train", "vase", "wolf", "yarn", "cloud", "brick", "plant", "smile",
    "sugar", "tooth", "wheel", "cheese", "garden", "pencil", "rabbit", "window", "yellow", "basket",
    "candle", "dragon", "forest", "guitar", "hammer", "island", "jacket", "ladder", "mirror", "orange",
    "pepper", "rocket", "silver", "summer", "turtle", "violin", "winter", "blue", "green", "black",
    "white", "red", "cold", "warm", "fast", "slow", "soft", "loud", "dark", "light",
    "north", "south", "east", "west", "flute", "honey", "paper", "glass", "metal", "cotton",
)
