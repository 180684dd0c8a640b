package agentconfig

import (
	"slices"
	"strings"
	"testing"
)

// TestStartJobCommandValidate: cluster.start_job_command is a program by absolute path with only its
// placeholders, and its timeout is positive and short enough for the asking agent, which waits for the
// whole start; unset, nothing is run and only the timeout (its default) is checked.
func TestStartJobCommandValidate(t *testing.T) {
	const script = `"/usr/lib/ftkit/ftkit-start-job-slurm"`
	for _, tt := range []struct {
		name, cluster, wantErr string
	}{
		{"unset", "", ""},
		{"every placeholder", `start_job_command = [` + script + `, "{uid}", "{gid}", "{host}", "{peer}", "{slurm_job_id}"]`, ""},
		{"placeholders inside arguments", `start_job_command = [` + script + `, "--user={uid}:{gid}", "--job={slurm_job_id}"]`, ""},
		{"the longest timeout", `start_job_command = [` + script + `]` + "\n" + `start_job_command_timeout = "20s"`, ""},
		{"relative program", `start_job_command = ["ftkit-start-job-slurm", "{uid}"]`, "give the program by absolute path"},
		{"unknown placeholder", `start_job_command = [` + script + `, "{address}"]`, "the only placeholders are {uid} {gid} {host} {peer} {slurm_job_id}"},
		{"stray brace", `start_job_command = [` + script + `, "{uid"]`, "the only placeholders"},
		{"zero timeout", `start_job_command_timeout = "0s"`, "must be positive and at most 20s"},
		{"negative timeout", `start_job_command_timeout = "-1s"`, "must be positive"},
		{"timeout beyond the asking agent's wait", `start_job_command = [` + script + `]` + "\n" + `start_job_command_timeout = "21s"`, "at most 20s"},
		{"unknown key", `start_job_commands = [` + script + `]`, "unknown key"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			src := minimal
			if tt.cluster != "" {
				src += "[cluster]\n" + tt.cluster + "\n"
			}
			c, err := ParseConfig([]byte(src))
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("ParseConfig: %v", err)
				}
				if c.Cluster.StartJobCommandTimeout.Duration <= 0 || len(c.Cluster.Members) != 2 {
					t.Fatalf("parsed %+v", c.Cluster)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("ParseConfig = %v, want an error with %q", err, tt.wantErr)
			}
		})
	}
}

// TestExpandStartJobCommand: each placeholder becomes its value within its own argument; an absent Slurm
// job id is an empty argument, never a missing one (the command's arguments keep their positions).
func TestExpandStartJobCommand(t *testing.T) {
	argv := []string{"/usr/lib/ftkit/ftkit-start-job-slurm", "{uid}", "{gid}", "{host}", "{peer}", "{slurm_job_id}", "--as={uid}:{gid}"}
	for _, tt := range []struct {
		name string
		a    StartJobArgs
		want []string
	}{
		{"with a Slurm job", StartJobArgs{UID: 1000, GID: 100, Host: "node2", Peer: "node1", SlurmJobID: "42"},
			[]string{argv[0], "1000", "100", "node2", "node1", "42", "--as=1000:100"}},
		{"without", StartJobArgs{UID: 0, GID: 0, Host: "node3", Peer: "spare1"},
			[]string{argv[0], "0", "0", "node3", "spare1", "", "--as=0:0"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := ExpandStartJobCommand(argv, tt.a); !slices.Equal(got, tt.want) {
				t.Errorf("ExpandStartJobCommand = %q, want %q", got, tt.want)
			}
		})
	}
}
