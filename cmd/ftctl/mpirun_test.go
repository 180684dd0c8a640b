package main

import (
	"slices"
	"testing"
)

// genv is hydra's -genv NAME VALUE pairs of an mpiexec.mpich command line.
func genv(argv []string) map[string]string {
	env := map[string]string{}
	for i := 0; i+2 < len(argv); i++ {
		if argv[i] == "-genv" {
			env[argv[i+1]] = argv[i+2]
		}
	}
	return env
}

// TestMPICHLauncherArgv: every MPICH rank talks to every other over TCP only, whatever it thinks of their
// hostnames (lab hosts share one): no ch4 shared memory, no UCX shared-memory or cross-memory transport, and
// without --eager-only=false no UCX rendezvous. The program's words come last, untouched.
func TestMPICHLauncherArgv(t *testing.T) {
	for _, eager := range []bool{true, false} {
		f := &mpiRunFlags{impl: "mpich", mpirun: "true", eagerOnly: eager}
		p := &mpiPlan{ranks: []string{"node1", "node2", "node3"}, dir: t.TempDir(), cidrs: "10.0.0.0/24"}
		argv, err := f.launcherArgv(p, "/usr/bin/ftctl", []string{"ring", "-genv", "X", "1"})
		if err != nil {
			t.Fatal(err)
		}
		if got := argv[len(argv)-4:]; !slices.Equal(got, []string{"ring", "-genv", "X", "1"}) {
			t.Errorf("argv ends %q, want the program's words", got)
		}
		i := slices.Index(argv, "-hosts")
		if i < 0 || argv[i+1] != "localhost,node2,node3" {
			t.Errorf("argv %q: want -hosts localhost,node2,node3", argv)
		}
		env := genv(argv[:len(argv)-4])
		want := map[string]string{"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0", "UCX_KEEPALIVE_INTERVAL": "inf"}
		if eager {
			want["UCX_RNDV_THRESH"] = "inf"
		}
		for k, v := range want {
			if env[k] != v {
				t.Errorf("eager-only %v: -genv %s %q, want %q (argv %q)", eager, k, env[k], v, argv)
			}
		}
		if _, ok := env["UCX_RNDV_THRESH"]; !eager && ok {
			t.Errorf("--eager-only=false still sets UCX_RNDV_THRESH: %q", argv)
		}
	}
}
