// Package deploy holds what installs ftkit on a host (the systemd unit, the .deb's nfpm configuration, the
// site scripts the package ships); its test builds the .deb and installs it into a temporary root.
package deploy

import _ "embed"

// SlurmStartJobScript is the cluster.start_job_command the package ships for Slurm sites
// (/usr/lib/ftkit/ftkit-start-job-slurm): it admits a user's forwarded job only on a host where the user
// has a running Slurm job. The lab's Slurm runs this very script (lab/slurm).
//
//go:embed slurm/ftkit-start-job-slurm
var SlurmStartJobScript []byte

// SlurmStartJobPath is where the package installs SlurmStartJobScript.
const SlurmStartJobPath = "/usr/lib/ftkit/ftkit-start-job-slurm"
