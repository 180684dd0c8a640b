//go:build linux

package restore

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strings"
)

// The tests set up and read nftables with the nft binary (scripts/setup.sh installs it): its own reading
// of the guard is the check that the agent's netlink batch is the table nft would build.

// nft runs an nft script (one transaction) in the calling thread's network namespace: exec forks from
// the calling thread.
func nft(ctx context.Context, script string) error {
	bin, err := nftBinary()
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, bin, "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("nft: %w: %s", err, bytes.TrimSpace(out.Bytes()))
	}
	return nil
}

// nftBinary finds nft, also in the sbin directories a PATH may lack.
func nftBinary() (string, error) {
	for _, p := range []string{"nft", "/usr/sbin/nft", "/sbin/nft"} {
		if p, err := exec.LookPath(p); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("the tests need the nft binary (scripts/setup.sh installs nftables)")
}
