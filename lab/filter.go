package lab

import (
	"fmt"
	"os/exec"
	"strings"
)

// Filter loads the nftables table "inet <table>" with the given chains into host's namespace (a test's
// drop or reject rules); remove deletes it again, and does nothing for a host that crashed since (its
// namespace took the table with it).
func (l *Lab) Filter(host, table, chains string) (remove func() error, err error) {
	nft := func(stdin string, args ...string) error {
		return l.Do(host, func() error {
			cmd := exec.Command("nft", args...)
			cmd.Stdin = strings.NewReader(stdin)
			if out, err := cmd.CombinedOutput(); err != nil {
				return fmt.Errorf("nft %s on %s: %w: %s", strings.Join(args, " "), host, err, out)
			}
			return nil
		})
	}
	if err := nft(fmt.Sprintf("table inet %s {\n%s\n}\n", table, chains), "-f", "-"); err != nil {
		return nil, err
	}
	done := false
	return func() error {
		if h, err := l.Host(host); done || err != nil || h.Crashed {
			return nil
		}
		done = true
		return nft("", "delete", "table", "inet", table)
	}, nil
}
