"""The runtime model and `peerd plan`: which algorithm and topology win on these links and hosts.

    from peerd.plan import model, sources
    net = sources.network_from_profile(profile.load("two-sites"))
    preds = model.plan(net, sources.compute_from_profile(prof, 0.2), 100e6)
    best, runner_up = model.recommend(preds)

Modules: model (the formulas; pure), sources (inputs from a lab profile or the live link matrix),
check (predicted vs measured iteration times).
"""
