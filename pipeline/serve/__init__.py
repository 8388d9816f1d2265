"""The Ray Serve decode endpoint, one concern a module; `jobs/serve.py` is its command.

    settings.py     ServeSettings: everything the deployments need; MIN:MAX autoscale parsing
    errors.py       ApiError, the OpenAI-style error body, classify (exception -> status),
                    the FastAPI exception handlers
    body.py         a request body read under limits: media type (415), size (413), depth (400)
    schemas.py      the request bodies (pydantic) and parse_body (400 / 422 naming the field)
    openai_chat.py  the OpenAI chat wire format: completion objects, server-sent event chunks
    decoder.py      the Decoder deployment: the model and the LRU of episodic caches
    ingress.py      the Router deployment: the HTTP ingress (the FastAPI app), the encoder, the
                    limits checked on the body, the question planned (pipeline.answer.plan),
                    the live tail rendered with the model's chat template
    affinity.py     ConversationAffinityRouter: a conversation's calls to one decoder replica
                    (rendezvous hashing, bounded load), Serve's RequestRouter
    app.py          resolve_models, build_app (router bound to decoder), app_builder

The package sits on `pipeline.answer` (and nothing in the library imports it); `jobs/serve.py`
is its command. Importing the package imports none of its modules; the HTTP API is documented in
docs/serving.md.
"""
