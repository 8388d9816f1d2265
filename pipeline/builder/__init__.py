"""The build: a corpus in, episodic caches and manifests out, one conversation at a time or on Ray.

    plan.py          stage 1, whichever way: a clustering, an append's plan or a repair's
    cluster.py       stage 1: the conversation cut to fit, and its episodes
    turns.py         stage 1's second product: the turn index the top-up reads, embedded
    growth.py        stage 1 of a grown conversation: its new windows placed in the episodes,
                     or why it is re-clustered (GrowthConfig)
    repair.py        a built conversation's damaged objects found (the skip check) and rebuilt
                     alone: stage 1's plan and stage 3's episode
    profile.py       stage 2: the layer profile (once per model) and the layer budgets
    episode.py       stage 3: one episode's cache and its manifest record
    append.py        stage 3 of a grown conversation: the new turns prefilled into a stored cache
    conversation.py  stage 4: the commit; the whole build of one conversation in one process
    tasks.py         the stages as Ray tasks
    sources.py       a corpus's objects, local or on S3
    driver.py        the Ray driver: run_build; run_job (an opened job, on Ray)
    job.py           the build as one job: corpus checked and store opened first (no torch,
                     no Ray: open_job), skip report, Summary, BuildError

What a build is configured with (BuildConfig, hashed; DriverOptions, not) is in pipeline.config.
"""
