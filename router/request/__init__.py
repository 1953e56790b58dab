"""One request, from its body to its route and back: the prompt (tokens, chain), the route
(a frozen value), and the accounting once the answer is known."""
