"""`cephalo run`: the whole Cephalo flow on one machine — discover devices, profile each
device type, plan, launch one trainer process per device, train and report."""
